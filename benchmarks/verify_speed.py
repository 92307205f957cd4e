"""What `advise --verify 5` adds to the analytic search, on a large trace.

    python benchmarks/verify_speed.py                 # ~1M events: examples/gpt_lm.py, 760 layers
    python benchmarks/verify_speed.py --layers 100    # quicker

Profiles examples/gpt_lm.py for real on this CPU (3 steps, d_model 64: many small ops,
so the trace is long while the model stays small), then times, side by side in one run,
`advise TRACE --budget B --gpus 2 --gpu h100-80gb` with `--verify 0` and with `--verify 5` (fake
execution of the top five plans on a simulated H100, ranks 0 and 1).  The budget is 80% of
the baseline's peak on the GPU so that plans must save memory.  Prints the trace's events,
both wall times, what verification added, and per executed plan its seconds and the
analytic-vs-executed difference.  The target (issue 12): at most 60 s added for a 1M-event
trace on this project's 2-core machine.
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
