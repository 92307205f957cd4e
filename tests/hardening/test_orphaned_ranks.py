"""A `kill -9` of `memadvisor apply --nproc 2` must not leave its ranks running."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

CHECKOUT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the parent-death signal is Linux's")

SLOW = textwrap.dedent('''
    import time
    import torch
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        x, y = torch.randn(8, 4), torch.randn(8, 1)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print("started", flush=True)
        time.sleep(120)
''')


def _ranks(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "memadvisor.apply.rank_main" in cmdline and marker in cmdline:
            found.append(int(entry.name))
    return found


def test_ranks_end_when_apply_is_killed(tmp_path):
    marker = f"orphan_{os.getpid()}"
    script = tmp_path / f"{marker}.py"
    script.write_text(SLOW)
    env = {**os.environ, "PYTHONPATH": str(CHECKOUT)}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "memadvisor.cli", "apply", str(script), "--plan",
         "shard=ddp,world=2", "--nproc", "2", "-q"], cwd=tmp_path, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while len(_ranks(marker)) < 2 and time.monotonic() < deadline:
            assert launcher.poll() is None, launcher.stdout.read()
            time.sleep(0.5)
        ranks = _ranks(marker)
        assert len(ranks) == 2, "the two ranks never started"
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=30)
        deadline = time.monotonic() + 30
        while _ranks(marker) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _ranks(marker) == [], "ranks outlived their launcher"
    finally:
        for pid in _ranks(marker):
            os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
