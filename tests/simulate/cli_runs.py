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
