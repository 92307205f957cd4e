"""The memadvisor command in a subprocess from the checkout, for the tests that profile a
script and run `apply --profile` to compare the simulator with a measured run."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def run_cli(*args, timeout: int = 300) -> None:
    """``memadvisor ARGS`` at the checkout's root, one torch thread; asserts it succeeded."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "memadvisor.cli", *map(str, args)],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]


def check_stages_against_apply_profile(script, args, plan: str, stages: list[dict], folder,
                                       target: float, timeout: int = 600) -> dict[int, int]:
    """Run ``apply --plan PLAN --profile`` (every rank writes its trace) and hold each rank's
    analysed-step peak to its stage's predicted ``peak_bytes`` within ``target``; unless
    zero1 (whose replicas own different shares of the state), every rank of a stage must
    measure what the stage's first rank does.  Returns rank -> measured bytes."""
    from memadvisor.plan import Plan
    from memadvisor.trace.analysis import analysed_step
    from memadvisor.trace.io import read_trace

    parsed = Plan.parse(plan)
    tag = plan.replace("=", "").replace(",", "_")
    measured_path = folder / f"{tag}.trace"
    run_cli("apply", script, "--plan", plan, "-o", folder / f"{tag}.py", "-q", "--profile",
            measured_path, "--profile-steps", "3", "--", *args, timeout=timeout)
    measured = {}
    for rank in range(parsed.world):
        found = read_trace(str(measured_path if rank == 0
                               else folder / f"{tag}.rank{rank}.trace"))
        measured[rank] = found.meta.steps[analysed_step(found)]["peak_bytes"]
        stage = (rank // parsed.tp) % parsed.pp  # the (dp, pp, tp) order, tp innermost
        predicted = stages[stage]["peak_bytes"]
        assert abs(predicted - measured[rank]) / measured[rank] <= target, \
            (plan, rank, predicted, measured[rank])
        if parsed.shard != "zero1":
            assert measured[rank] == measured[stage * parsed.tp], (plan, rank, measured)
    return measured
