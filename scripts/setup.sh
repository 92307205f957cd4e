#!/usr/bin/env bash
# Install memadvisor and everything its tests need on a fresh machine (idempotent).
# torch is pinned: an unpinned torch pulls several GB of CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m pip install -q --disable-pip-version-check "torch==2.13.0"
$PY -m pip install -q --disable-pip-version-check -e ".[test]"
if [ "${MEMADVISOR_SKIP_BROWSER:-0}" != 1 ] && [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null; then
  # browser tests drive the system Chromium through Playwright (never `playwright install`)
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    || echo "setup: could not install chromium; browser tests will be skipped" >&2
fi
