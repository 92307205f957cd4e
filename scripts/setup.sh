#!/usr/bin/env bash
# Install memadvisor and everything its tests need on a fresh machine (idempotent), in a
# virtual environment: ./.venv, unless one is active already ($VIRTUAL_ENV).  A venv works
# with any python >= 3.10, Debian/Ubuntu's own included (which refuse a global pip install:
# "externally-managed-environment").  torch is pinned: an unpinned torch pulls several GB
# of CUDA packages.  MEMADVISOR_SKIP_BROWSER=1 skips Chromium (only the browser tests use it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
  echo "setup: memadvisor needs python >= 3.10 (found: $("$PY" --version 2>&1)); set PYTHON=" >&2
  exit 2
fi
if [ -n "${VIRTUAL_ENV:-}" ]; then
  VENV=$VIRTUAL_ENV
else
  VENV=.venv
  if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV" || {
      echo "setup: could not create $VENV (on Debian/Ubuntu: apt-get install python3-venv)" >&2
      exit 2; }
  fi
fi
VPY="$VENV/bin/python"
"$VPY" -m pip install -q --disable-pip-version-check "torch==2.13.0"
# the zoo extra (transformers, lightning, accelerate): the framework tests of `apply`;
# torch named again so that pip keeps the pinned one while resolving them
"$VPY" -m pip install -q --disable-pip-version-check -e ".[test,zoo]" "torch==2.13.0"
if [ "${MEMADVISOR_SKIP_BROWSER:-0}" != 1 ] && [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null; then
  # browser tests drive the system Chromium through Playwright (never `playwright install`)
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    || echo "setup: could not install chromium; browser tests will be skipped" >&2
fi
echo "setup: ready in $VENV (activate it: source $VENV/bin/activate)" >&2
