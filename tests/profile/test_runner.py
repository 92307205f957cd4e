"""profile_script in-process: the script sees what `python script.py ARGS` gives it, every
way it can end keeps a trace with the right status, and the caller's state comes back."""
from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

from memadvisor.errors import UserError
from memadvisor.profile import profile_script, rank_output_path
from memadvisor.trace import read_trace

TRAIN_LOOP = """
import torch
torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
def train(steps):
    for _ in range(steps):
        loss = model(torch.randn(16, 8)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
"""


def _script(folder: Path, name: str, body: str) -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(body))
    return path


def test_the_script_sees_what_python_would_give_it(tmp_path, monkeypatch):
    folder = tmp_path / "project"
    folder.mkdir()
    report = tmp_path / "seen.json"
    script = _script(folder, "train.py", f"""
        import json, sys
        json.dump({{"name": __name__, "file": __file__, "argv": sys.argv,
                   "path0": sys.path[0]}}, open({str(report)!r}, "w"))
        """)
    monkeypatch.chdir(tmp_path)
    argv_before, path0_before = list(sys.argv), sys.path[0]
    main_before = sys.modules["__main__"]
    sigterm_before = signal.getsignal(signal.SIGTERM)
    result = profile_script(script, ["--lr", "0.1", "data dir"], tmp_path / "t.trace")
    seen = json.loads(report.read_text())
    assert seen["name"] == "__main__"
    assert Path(seen["file"]).resolve() == script.resolve()
    assert seen["argv"][1:] == ["--lr", "0.1", "data dir"]
    assert Path(seen["argv"][0]).resolve() == script.resolve()
    assert Path(seen["path0"]).resolve() == folder.resolve()
    # and the caller's state is back
    assert sys.argv == argv_before
    assert sys.path[0] == path0_before
    assert sys.modules["__main__"] is main_before
    assert signal.getsignal(signal.SIGTERM) is sigterm_before
    assert result.status == "completed" and result.exit_code == 0
    assert read_trace(result.trace_path).meta.argv[1:] == ["--lr", "0.1", "data dir"]


def test_stops_after_the_requested_steps_even_inside_except_exception(tmp_path):
    script = _script(tmp_path, "swallow.py", TRAIN_LOOP + """
try:
    train(50)
except Exception:
    print("swallowed")
raise SystemExit("the script ran on past the requested steps")
""")
    result = profile_script(script, [], tmp_path / "t.trace", steps=3)
    assert result.status == "completed", result.error
    assert result.exit_code == 0
    assert result.steps_completed == 3
    trace = read_trace(result.trace_path)
    meta = trace.meta
    assert meta.steps_completed == 3
    assert meta.steps_requested == 3
    # the peak profile prints is the one every reader counts (parameters made before the
    # recording included), as `summary` shows it
    from memadvisor.trace.analysis import live_bytes
    assert result.peak_bytes == int(live_bytes(trace.events).max())


def test_the_script_ending_before_the_steps_is_completed(tmp_path):
    script = _script(tmp_path, "short.py", TRAIN_LOOP + "train(2)\n")
    result = profile_script(script, [], tmp_path / "t.trace", steps=3)
    assert (result.status, result.exit_code, result.steps_completed) == ("completed", 0, 2)


@pytest.mark.parametrize("code, exit_code, status", [
    ("0", 0, "completed"),
    ("None", 0, "completed"),
    ("3", 3, "error"),
    ("'bad config'", 1, "error"),
])
def test_sys_exit(tmp_path, code, exit_code, status):
    script = _script(tmp_path, "exits.py", TRAIN_LOOP + f"train(1)\nimport sys\nsys.exit({code})\n")
    result = profile_script(script, [], tmp_path / "t.trace", steps=3)
    assert (result.exit_code, result.status) == (exit_code, status)
    meta = read_trace(result.trace_path).meta
    assert meta.status == status
    assert meta.steps_completed == 1


def test_an_error_keeps_the_trace_and_a_one_line_description(tmp_path):
    script = _script(tmp_path, "fails.py", TRAIN_LOOP + """
train(2)
raise ValueError("batch 7 is empty")
""")
    result = profile_script(script, [], tmp_path / "t.trace", steps=5)
    assert (result.status, result.exit_code, result.steps_completed) == ("error", 1, 2)
    assert result.error == "ValueError: batch 7 is empty"
    assert 'fails.py", line' in result.traceback
    assert "memadvisor" not in result.traceback
    assert read_trace(result.trace_path).meta.error == result.error


def test_a_multi_line_error_message_keeps_its_type_and_first_line(tmp_path):
    script = _script(tmp_path, "fails_long.py", TRAIN_LOOP + """
train(1)
raise RuntimeError("shape mismatch in layer 3\\n  expected (4, 8)\\n  got (4, 9)")
""")
    result = profile_script(script, [], tmp_path / "t.trace", steps=5)
    assert result.status == "error"
    assert "\n" not in result.error
    assert "RuntimeError" in result.error
    assert "shape mismatch in layer 3" in result.error


def test_keyboard_interrupt_and_sigterm_are_interrupted(tmp_path):
    ctrl_c = _script(tmp_path, "ctrl_c.py", TRAIN_LOOP + "train(2)\nraise KeyboardInterrupt\n")
    result = profile_script(ctrl_c, [], tmp_path / "a.trace", steps=5)
    assert (result.status, result.exit_code, result.steps_completed) == ("interrupted", 130, 2)
    sigterm = _script(tmp_path, "sigterm.py", TRAIN_LOOP + """
import os, signal, time
train(2)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(5)
raise SystemExit("SIGTERM did not stop the script")
""")
    before = signal.getsignal(signal.SIGTERM)
    result = profile_script(sigterm, [], tmp_path / "b.trace", steps=5)
    assert (result.status, result.exit_code, result.steps_completed) == ("interrupted", 130, 2)
    assert read_trace(result.trace_path).meta.status == "interrupted"
    assert signal.getsignal(signal.SIGTERM) is before


def test_timeout_counts_from_the_last_step(tmp_path):
    script = _script(tmp_path, "hangs.py", TRAIN_LOOP + """
import time
train(2)
while True:
    time.sleep(0.05)  # waiting on a queue that never fills, in short polls
""")
    started = time.monotonic()
    # 4 s, not 1: on a loaded machine (load 12 on 2 cores) the two steps took longer than
    # 1 s and the timeout fired before the first; the hang after them is what is timed
    result = profile_script(script, [], tmp_path / "t.trace", steps=5, timeout_s=4.0)
    assert (result.status, result.exit_code, result.steps_completed) == ("timeout", 124, 2)
    assert "after 2 steps" in result.error
    assert time.monotonic() - started < 30


def test_timeout_interrupts_a_step_blocked_in_one_call(tmp_path):
    script = _script(tmp_path, "blocks.py", TRAIN_LOOP + """
import time
train(2)
time.sleep(8)  # one blocking call: a hung read, a collective that never completes
raise SystemExit("the timeout did not interrupt the blocking call")
""")
    started = time.monotonic()
    result = profile_script(script, [], tmp_path / "t.trace", steps=5, timeout_s=1.0)
    elapsed = time.monotonic() - started
    assert result.status == "timeout"
    assert elapsed < 5, f"the timeout of 1 s fired after {elapsed:.1f} s"


def test_bad_scripts_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="no such script"):
        profile_script(tmp_path / "missing.py", [], tmp_path / "t.trace")
    with pytest.raises(UserError, match="directory"):
        profile_script(tmp_path, [], tmp_path / "t.trace")
    bad = _script(tmp_path, "bad.py", "x = 1\nif x\n    pass\n")
    with pytest.raises(UserError, match=r"bad\.py:2: SyntaxError"):
        profile_script(bad, [], tmp_path / "t.trace")
    assert not (tmp_path / "t.trace").exists()


def test_rank_output_path(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert rank_output_path("runs/a.trace") == Path("runs/a.trace")
    monkeypatch.setenv("RANK", "0")
    assert rank_output_path("runs/a.trace") == Path("runs/a.trace")
    monkeypatch.setenv("RANK", "3")
    assert rank_output_path("runs/a.trace") == Path("runs/a.rank3.trace")


def test_rank_r_writes_its_own_file(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    script = _script(tmp_path, "ranked.py", TRAIN_LOOP + "train(3)\n")
    result = profile_script(script, [], tmp_path / "run.trace", steps=3)
    assert result.trace_path == tmp_path / "run.rank1.trace"
    assert not (tmp_path / "run.trace").exists()
    meta = read_trace(result.trace_path).meta
    assert (meta.rank, meta.world_size) == (1, 2)
    assert os.environ["RANK"] == "1"
