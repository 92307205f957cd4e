#!/usr/bin/env bash
# Set up from scratch, then run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec python3 -m pytest -q -p no:cacheprovider "$@"
