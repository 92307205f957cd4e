"""`profile --timeout` fires in a process that ignores SIGINT, as every command a
non-interactive shell starts in the background (`cmd &`, nohup) does."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]


def test_the_timeout_fires_when_sigint_is_ignored(tmp_path):
    script = tmp_path / "hangs.py"
    script.write_text(textwrap.dedent('''
        import time
        import torch
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            model(torch.randn(8, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        while True:
            time.sleep(0.05)
    '''))
    env = {**os.environ, "PYTHONPATH": str(CHECKOUT)}
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "memadvisor.cli", "profile", str(script), "-o",
         str(tmp_path / "t.trace"), "--steps", "5", "--timeout", "1", "-q"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert proc.returncode == 124, proc.stderr
    assert "after 2 step" in proc.stderr
    assert time.monotonic() - started < 60
