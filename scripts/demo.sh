#!/usr/bin/env bash
# Set up from scratch, then the main job on a bundled example: profile -> summary/advise -> report.
set -euo pipefail
cd "$(dirname "$0")/.."
MEMADVISOR_SKIP_BROWSER=1 bash scripts/setup.sh  # the demo opens no browser
export PATH="${VIRTUAL_ENV:-$PWD/.venv}/bin:$PATH"  # what scripts/setup.sh installed into
mkdir -p reports
EXAMPLE=${1:-gpt_lm}
ARGS=()
[ "$EXAMPLE" = gpt_lm ] && ARGS=(-- --n-layer 4 --d-model 128 --batch-size 8)
memadvisor profile "examples/$EXAMPLE.py" -o "reports/$EXAMPLE.trace" --steps 3 "${ARGS[@]}"
memadvisor summary "reports/$EXAMPLE.trace"
if memadvisor advise --help >/dev/null 2>&1; then
  memadvisor advise "reports/$EXAMPLE.trace" --budget 64MiB --gpus 2
fi
memadvisor report "reports/$EXAMPLE.trace" --budget 64MiB --gpus 2 -o "reports/$EXAMPLE.html"
echo "report: reports/$EXAMPLE.html (self-contained; open it in a browser)"
