#!/usr/bin/env bash
# Set up from scratch, then run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${VIRTUAL_ENV:-$PWD/.venv}
# the venv's tools first: tests start `memadvisor` and `python` in subprocesses
export PATH="$VENV/bin:$PATH"
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
