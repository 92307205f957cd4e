#!/usr/bin/env bash
# Record real-GPU ground truth for memadvisor in one pass (device machine; see README.md here).
#   bash benchmarks/gpu_real/run_on_gpu.sh OUTDIR CASES_DIR
# CASES_DIR holds large.txt (name|script|args), small.txt (same) and plans/NAME__PLAN.py (the
# scripts `memadvisor apply --no-run` wrote for each plan).  Phases, each packed when done so
# a run stopped at its time limit still returns what finished:
#   1 truth: every case run plainly (record.py, no memadvisor in the process); large cases
#     also dump a snapshot of step 3 (packed with the records)
#   2 plans: every applied plan script run plainly (record.py)
#   3 profile: `memadvisor profile` on the GPU (dispatch engine) for every case
#   4 apply: `memadvisor apply --profile` on the GPU for a few plans (the CLI end to end)
# PHASES (default "1 2 3 4") picks phases; SNAP_SMALL / SNAP_PLANS (step numbers) also dump a
# snapshot of that step for the small cases / the plan runs.
out=${1:?OUTDIR}; cases=${2:?CASES_DIR}
here=$(cd "$(dirname "$0")" && pwd)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PY:-python3}
log=$out/log.txt
mkdir -p "$out" /tmp/gr/truth /tmp/gr/plans /tmp/gr/profile /tmp/gr/apply
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv;
  $PY -c 'import torch,sys; print(sys.version); print(torch.__version__, torch.version.cuda, torch.backends.cudnn.version(), torch.cuda.get_device_name(), torch.cuda.get_device_properties(0))'
  env | grep -E "^(CUBLAS|CUDNN|PYTORCH|OMP)" ; } >"$out/env.txt" 2>&1
PHASES=" ${PHASES:-1 2 3 4} "

truth() {  # name script args... (snapshot step as env SNAP)
  local name=$1 dir=$2; shift 2
  local snap=()
  [ -n "${SNAP:-}" ] && snap=(--snapshot-step "$SNAP")
  timeout 150 $PY "$here/record.py" "$dir/$name" "${snap[@]}" "$@" >"$dir/$name.log" 2>&1
  echo "$(date -u +%T) $dir $name rc=$?" >>"$log"
}
export -f truth; export here PY log

# phase 1: plain runs of every case
if [[ $PHASES == *" 1 "* ]]; then
while IFS='|' read -r name script args; do
  [ -n "$name" ] && echo "SNAP=3 truth $name /tmp/gr/truth $script $args"
done <"$cases/large.txt" >/tmp/gr/p1.txt
while IFS='|' read -r name script args; do
  [ -n "$name" ] && echo "${SNAP_SMALL:+SNAP=$SNAP_SMALL }truth $name /tmp/gr/truth $script $args"
done <"$cases/small.txt" >>/tmp/gr/p1.txt
xargs -P 8 -I{} bash -c '{}' </tmp/gr/p1.txt
tar czf "$out/truth.tgz" -C /tmp/gr truth
echo "$(date -u +%T) phase 1 packed" >>"$log"
fi

# phase 2: plain runs of every applied plan
if [[ $PHASES == *" 2 "* ]]; then
while IFS='|' read -r name script args; do
  [ -n "$name" ] || continue
  for p in "$cases"/plans/"$name"__*.py; do
    [ -f "$p" ] && echo "${SNAP_PLANS:+SNAP=$SNAP_PLANS }truth $(basename "$p" .py) /tmp/gr/plans $p $args"
  done
done <"$cases/large.txt" >/tmp/gr/p2.txt
xargs -P 8 -I{} bash -c '{}' </tmp/gr/p2.txt
tar czf "$out/plans.tgz" -C /tmp/gr plans
echo "$(date -u +%T) phase 2 packed" >>"$log"
fi

# phase 3: memadvisor profile on the GPU
if [[ $PHASES == *" 3 "* ]]; then
prof() {
  local name=$1 script=$2; shift 2
  timeout 200 $PY -m memadvisor.cli profile "$script" -o "/tmp/gr/profile/$name.trace" --steps 4 \
    -- "$@" >"/tmp/gr/profile/$name.log" 2>&1
  echo "$(date -u +%T) profile $name rc=$?" >>"$log"
}
export -f prof
cat "$cases/large.txt" "$cases/small.txt" | while IFS='|' read -r name script args; do
  [ -n "$name" ] && echo "prof $name $script $args"
done >/tmp/gr/p3.txt
xargs -P 8 -I{} bash -c '{}' </tmp/gr/p3.txt
timeout 200 $PY -m memadvisor.cli profile --engine native examples/gpt_lm.py \
  -o /tmp/gr/profile/native_gpt.trace --steps 4 -- --steps 5 >/tmp/gr/profile/native_gpt.log 2>&1
echo "$(date -u +%T) profile native_gpt rc=$?" >>"$log"
tar czf "$out/profile.tgz" -C /tmp/gr profile
echo "$(date -u +%T) phase 3 packed" >>"$log"
fi

# phase 4: apply --profile end to end
if [[ $PHASES == *" 4 "* ]]; then
app() {
  local name=$1 plan=$2 script=$3; shift 3
  timeout 200 $PY -m memadvisor.cli apply "$script" --plan "$plan" -q -o "/tmp/gr/apply/${name}_app.py" \
    --profile "/tmp/gr/apply/$name.trace" -- "$@" >"/tmp/gr/apply/$name.log" 2>&1
  echo "$(date -u +%T) apply $name rc=$?" >>"$log"
}
export -f app
[ -f "$cases/apply.txt" ] && xargs -P 4 -I{} bash -c '{}' <"$cases/apply.txt"
tar czf "$out/apply.tgz" -C /tmp/gr apply
echo "$(date -u +%T) phase 4 packed" >>"$log"
fi
