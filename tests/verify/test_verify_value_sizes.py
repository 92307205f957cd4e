"""A mixture-of-experts router's tokens per expert under fake execution: the profiled
run's share at each ``torch.where`` line, not every token to every expert."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CHECKOUT = Path(__file__).resolve().parents[2]


def _cli(*args, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(CHECKOUT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "memadvisor.cli", *map(str, args)],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_fake_cpu_execution_of_a_moe_follows_the_profiled_routing(tmp_path):
    """zoo/moe.py ``accum=2``: fake CPU execution against the real run of the same rewrite
    (2026-11-26: +66.8% with the upper bound, -0.12% with the recorded shares)."""
    trace = tmp_path / "moe.trace"
    done = _cli("profile", CHECKOUT / "zoo" / "moe.py", "-o", trace, "--steps", "3", "-q",
                cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = {}
    for how in ("fake", "real"):
        done = _cli("simulate", trace, "--plan", "accum=2", "--verify", "--verify-by", how,
                    "--json", cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-2000:]
        verification = json.loads(done.stdout)["verification"]
        assert verification["executed"], verification
        figures[how] = verification["executed_peak_bytes"]
    assert abs(figures["fake"] - figures["real"]) / figures["real"] < 0.01, figures
