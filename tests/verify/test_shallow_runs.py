"""A deep model's plan verified as shallow runs (verify/shallow_runs.py) gives the figures
of the run at the script's own depth: `simulate --verify` with `--verify-depth auto` (the
stack cut to 2, 3 and 4 layers, the full depth's requests made from them) against
`--verify-depth full`, on a simulated H100, per rank, to the byte."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from memadvisor.verify.shallow_runs import CUT_FROM_LAYERS

CHECKOUT = Path(__file__).resolve().parents[2]
GPT = CHECKOUT / "examples" / "gpt_lm.py"


def _cli(*args, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(CHECKOUT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "memadvisor.cli", *map(str, args)],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def deep_gpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shallow")
    done = _cli("profile", GPT, "-o", folder / "gpt.trace", "--steps", "3", "-q",
                "--no-probes", "--", "--n-layer", CUT_FROM_LAYERS, "--d-model", "64",
                "--batch-size", "8", cwd=folder)
    assert done.returncode == 0, done.stderr[-2000:]
    return folder / "gpt.trace"


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["precision=amp-bf16,accum=2",
                                  "shard=zero3,world=2,checkpoint=auto"])
def test_shallow_runs_give_the_full_depth_figures(deep_gpt, plan):
    figures = {}
    for depth in ("auto", "full"):
        done = _cli("simulate", deep_gpt, "--plan", plan, "--gpu", "h100-80gb", "--verify",
                    "--verify-depth", depth, "--json", cwd=deep_gpt.parent)
        assert done.returncode == 0, done.stderr[-2000:]
        verification = json.loads(done.stdout)["verification"]
        assert verification["executed"], verification
        figures[depth] = {r["rank"]: (r["peak_allocated_bytes"], r["peak_reserved_bytes"])
                          for r in verification["ranks"]}
        shallow = f"{CUT_FROM_LAYERS}-layer stack ran at 2, 3 and 4 layers"
        assert (shallow in verification["where"]) == (depth == "auto"), verification["where"]
        assert not any("ran at full depth" in w for w in verification["warnings"])
    assert figures["auto"] == figures["full"]
