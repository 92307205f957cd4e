"""Faults during `memadvisor apply --nproc 2`: a hanging rank is bounded by --timeout and
named; Ctrl-C or SIGTERM of the launcher ends the job in one line with 130/143."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from memadvisor.apply import watchdog

CHECKOUT = Path(__file__).resolve().parents[2]

LOOP = textwrap.dedent('''
    import os, time
    import torch
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(3):
        {hang}
        x, y = torch.randn(8, 4), torch.randn(8, 1)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        print("stepped", flush=True)
''')


def _apply(tmp_path: Path, hang: str, *options: str, wait: bool = True):
    script = tmp_path / "train.py"
    script.write_text(LOOP.replace("{hang}", hang))
    argv = [sys.executable, "-c", "from memadvisor.cli import console_main; console_main()",
            "apply", str(script), "--plan", "shard=zero2,world=2", "-q", *options]
    env = {**os.environ, "PYTHONPATH": str(CHECKOUT)}
    kwargs = dict(cwd=tmp_path, env=env, text=True,
                  preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    if not wait:
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, **kwargs)
    return subprocess.run(argv, capture_output=True, timeout=240, **kwargs)


def test_a_hanging_rank_is_ended_by_the_timeout_and_named(tmp_path):
    started = time.monotonic()
    proc = _apply(tmp_path, 'while i == 1 and os.environ["RANK"] == "1": time.sleep(0.05)',
                  "--timeout", "3")
    assert proc.returncode == watchdog.EXIT_TIMEOUT, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    # the rank stuck in the script is named, not its peer waiting in a collective
    assert last.startswith("memadvisor: error: rank 1 failed: no optimizer step for 3 s "
                           "after step 1: stuck at train_memadvisor.py:"), last
    assert time.monotonic() - started < 180


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_interrupting_the_launcher_stops_the_ranks_in_one_line(tmp_path, signum):
    proc = _apply(tmp_path, "time.sleep(60 if i == 1 else 0)", wait=False)
    stepped = 0
    while stepped < 2:  # both ranks did step 1 and now sleep
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        stepped += line.strip() == "stepped"
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, stderr
    assert "Traceback" not in stderr
    name = signal.Signals(signum).name
    assert stderr.strip().splitlines()[-1] == \
        f"memadvisor: error: interrupted by {name}; the ranks were stopped"


def test_the_watchdog_waits_longer_in_a_collective_and_counts_steps():
    messages = []
    now = [0.0]
    dog = watchdog.ProgressWatchdog(10.0, messages.append, clock=lambda: now[0])
    dog._stepped()
    dog._stepped()
    assert dog.steps == 2
    text = dog.message("train.py:12 (in all_gather_single)", True)
    assert text.startswith("no optimizer step for 10 s after step 2: waiting for the other "
                           "ranks at train.py:12")
    assert "stuck at train.py:3" in dog.message("train.py:3", False)
