"""What `advise --verify 5` adds to the analytic search, on a large trace.

    python benchmarks/verify_speed.py --layers 810    # ~1M events: examples/gpt_lm.py
    python benchmarks/verify_speed.py --layers 48 --compare-full   # shallow runs vs full depth

Profiles examples/gpt_lm.py for real on this CPU (3 steps, d_model 64: many small ops,
so the trace is long while the model stays small), then times, side by side in one run,
`advise TRACE --budget B --gpus 2 --gpu h100-80gb` with `--verify 0` and with `--verify 5` (fake
execution of the top five plans on a simulated H100, ranks 0 and 1).  The budget is 80% of
the baseline's peak on the GPU so that plans must save memory.  Prints the trace's events,
both wall times, what verification added, and per executed plan its seconds and the
analytic-vs-executed difference.  The target (issue 12): at most 60 s added for a 1M-event
trace on this project's 2-core machine.

Since a model with a stack of 12 or more alike layers is verified by shallow runs (the
stack cut to 2, 3 and 4 layers, the full depth's requests made from them:
verify/shallow_runs.py), ``--compare-full`` also runs `--verify-depth full` (every plan at
the script's own depth: slow, use a small --layers) and prints both executed figures per
plan and rank: they must be equal.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "memadvisor.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=760)
    parser.add_argument("--verify", type=int, default=5)
    parser.add_argument("--keep", type=Path, help="folder to keep the trace in (and reuse)")
    parser.add_argument("--compare-full", action="store_true",
                        help="also execute the plans at full depth and compare the figures")
    options = parser.parse_args()
    folder = options.keep or Path(tempfile.mkdtemp(prefix="verify-speed-"))
    folder.mkdir(parents=True, exist_ok=True)
    trace = folder / f"gpt_lm_{options.layers}.trace"
    if not trace.exists():
        started = time.monotonic()
        proc = _cli("profile", str(ROOT / "examples" / "gpt_lm.py"), "-o", str(trace),
                    "--steps", "3", "-q", "--no-probes", "--", "--n-layer", str(options.layers),
                    "--d-model", "64", "--batch-size", "8", cwd=folder)
        if proc.returncode:
            print(proc.stderr, file=sys.stderr)
            return 1
        print(f"profiled in {time.monotonic() - started:.0f} s")
    from memadvisor.trace.io import read_meta, read_trace
    events = len(read_trace(trace).events)
    meta = read_meta(trace)
    print(f"trace: {events:,} events, {meta.steps_completed} steps, {options.layers} layers")

    proc = _cli("simulate", str(trace), "--gpu", "h100-80gb", "--json", cwd=folder)
    baseline = json.loads(proc.stdout)["baseline_peak_bytes"]
    budget = f"{int(baseline * 0.8)}B"
    common = ("advise", str(trace), "--budget", budget, "--gpus", "2", "--gpu", "h100-80gb",
              "--json")
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    plain = _cli(*common, "--verify", "0", cwd=folder)  # a GPU target verifies by default
    plain_s = time.monotonic() - started
    started = time.monotonic()
    verified = _cli(*common, "--verify", str(options.verify), cwd=folder)
    verified_s = time.monotonic() - started
    for proc in (plain, verified):
        if proc.returncode not in (0, 1):
            print(proc.stderr, file=sys.stderr)
            return 1
    data = json.loads(verified.stdout)
    print(f"advise:                {plain_s:7.1f} s")
    print(f"advise --verify {options.verify}:     {verified_s:7.1f} s   "
          f"(+{verified_s - plain_s:.1f} s; target +60 s for 1M events)")
    for index, plan in enumerate(data["plans"], 1):
        record = plan.get("verification")
        if record:
            difference = (f"{record['difference']:+.1%}" if record["difference"] is not None
                          else record["failed"] or record["refused"])
            print(f"  #{index} {plan['plan_compact']}: {record['seconds']:.1f} s "
                  f"(after {record.get('waited_seconds', 0):.1f} s waiting for a core), "
                  f"analytic vs executed {difference}")
    print(f"cores: {os.cpu_count()}; load average {os.getloadavg()[0]:.1f} now, "
          f"{load_before:.1f} before advise (other jobs on this machine slow both runs)")
    if options.compare_full:
        return _compare_full(common, options.verify, data, verified_s, folder)
    return 0


def _figures(data: dict) -> dict:
    """plan -> rank -> (allocated, reserved) of every executed plan."""
    figures = {}
    for plan in data["plans"]:
        record = plan.get("verification")
        if record and record.get("executed"):
            figures[plan["plan_compact"]] = {
                r["rank"]: (r["peak_allocated_bytes"], r["peak_reserved_bytes"])
                for r in record["ranks"]}
    return figures


def _compare_full(common, verify: int, shallow: dict, shallow_s: float, folder) -> int:
    started = time.monotonic()
    proc = _cli(*common, "--verify", str(verify), "--verify-depth", "full", cwd=folder)
    full_s = time.monotonic() - started
    if proc.returncode not in (0, 1):
        print(proc.stderr, file=sys.stderr)
        return 1
    made, ran = _figures(shallow), _figures(json.loads(proc.stdout))
    print(f"advise --verify {verify} --verify-depth full: {full_s:7.1f} s "
          f"(shallow runs: {shallow_s:.1f} s)")
    differences = compared = 0
    for plan in sorted(set(made) & set(ran)):
        for rank in sorted(set(made[plan]) | set(ran[plan])):
            a, b = made[plan].get(rank), ran[plan].get(rank)
            compared += 1
            differences += a != b
            print(f"  {plan} rank {rank}: (allocated, reserved) shallow {a}, full depth {b}"
                  f"{'' if a == b else '   DIFFERENT'}")
    for plan in sorted(set(made) ^ set(ran)):  # the two searches stopped at other plans
        print(f"  {plan}: executed by {'the shallow' if plan in made else 'the full'} "
              "search only")
    print(f"{differences} of {compared} executed (plan, rank) figures differ")
    return 1 if differences or not compared else 0


if __name__ == "__main__":
    sys.exit(main())
