"""Faults during `memadvisor profile`: whatever ends the script, the steps done survive.

Each test runs the real command in a subprocess (signals, os._exit and segfaults must not
touch the test process) on a tiny model, and reads the trace back as the next command would.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from memadvisor.profile import checkpoint as checkpoint_module
from memadvisor.trace.io import read_trace

CHECKOUT = Path(__file__).resolve().parents[2]

TRAIN = textwrap.dedent('''
    import os, sys, time
    import torch
    model = torch.nn.Linear(16, 16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    def step():
        model(torch.randn(4, 16)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
''')


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "train.py"
    path.write_text(TRAIN + textwrap.dedent(body))
    return path


def _profile(tmp_path: Path, script: Path, *options: str, sigint_default: bool = True,
             wait: bool = True, **kwargs):
    argv = [sys.executable, "-c", "from memadvisor.cli import console_main; console_main()",
            "profile", str(script), "-o", str(tmp_path / "t.trace"), "-q", *options]
    env = {**os.environ, "PYTHONPATH": str(CHECKOUT)}
    # a shell's background job inherits SIGINT ignored; a terminal's does not
    preexec = (lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) if sigint_default else None
    if not wait:
        return subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, preexec_fn=preexec)
    return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240, preexec_fn=preexec, **kwargs)


@pytest.mark.parametrize("ending, returncode", [
    ("os._exit(3)", 3),
    ("import ctypes; ctypes.string_at(0)", -signal.SIGSEGV),
    ("os.kill(os.getpid(), 9)", -signal.SIGKILL),
])
def test_the_steps_done_survive_a_process_that_never_returns(tmp_path, ending, returncode):
    script = _script(tmp_path, f'''
        for i in range(10):
            step()
            if i == 2:
                {ending}
    ''')
    proc = _profile(tmp_path, script, "--steps", "5")
    assert proc.returncode == returncode, proc.stderr
    trace = read_trace(tmp_path / "t.trace")
    assert trace.meta.steps_completed == 3
    assert int(trace.events["step"].max()) <= 3
    if returncode == 3:  # os._exit: the trace was written on the way out, and it says so
        assert trace.meta.status == "error" and "os._exit(3)" in trace.meta.error
        assert "os._exit(3)" in proc.stderr
    else:  # nothing ran after the crash: the checkpoint of step 3 says what it is
        assert trace.meta.status == checkpoint_module.INCOMPLETE
        assert "3 steps" in trace.meta.error
    if returncode == -signal.SIGSEGV:  # the script's own stack is shown
        assert "train.py" in proc.stderr and "Segmentation fault" in proc.stderr


def test_running_out_of_host_memory_reports_the_scripts_error_and_keeps_the_trace(tmp_path):
    script = _script(tmp_path, '''
        import resource
        hold = []
        for i in range(10):
            step()
            if i == 1:
                # the address space limited to what is used now plus 64 MiB
                pages = int(open(f"/proc/{os.getpid()}/statm").read().split()[0])
                used = pages * os.sysconf("SC_PAGE_SIZE")
                resource.setrlimit(resource.RLIMIT_AS,
                                   (used + (64 << 20), resource.getrlimit(resource.RLIMIT_AS)[1]))
                while True:
                    hold.append(bytearray((8 << 20) if len(hold) < 7 else (64 << 10)))
    ''')
    proc = _profile(tmp_path, script, "--steps", "5")
    assert proc.returncode == 1, proc.stderr
    assert "MemoryError" in proc.stderr and "Traceback" not in proc.stderr
    trace = read_trace(tmp_path / "t.trace")
    assert trace.meta.steps_completed == 2


def test_a_final_write_that_fails_leaves_the_checkpoint_and_says_so(tmp_path, monkeypatch):
    from memadvisor.profile import runner
    script = _script(tmp_path, '''
        for i in range(4):
            step()
        raise RuntimeError("the script's own failure")
    ''')
    def out_of_space(path, table, meta):  # the final write only: checkpoints import their own
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(runner, "write_trace", out_of_space)
    result = runner.profile_script(script, [], tmp_path / "t.trace", steps=10, probes=False)
    assert result.status == "error" and "the script's own failure" in result.error
    assert "No space left" in result.write_error
    assert "as of step 4" in result.write_error
    kept = read_trace(tmp_path / "t.trace")
    assert kept.meta.status == checkpoint_module.INCOMPLETE
    assert kept.meta.steps_completed == 4


def test_repeated_ctrl_c_while_the_trace_is_written_keeps_it(tmp_path):
    script = _script(tmp_path, '''
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        steps = 0
        while True:
            model(torch.randn(32, 256)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
            if steps == 2:  # a step recorded, whatever the machine's load
                print("stepped", flush=True)
    ''')
    proc = _profile(tmp_path, script, "--steps", "0", wait=False)
    assert proc.stdout.readline().strip() == "stepped"
    time.sleep(0.2)
    deadline = time.monotonic() + 3
    while proc.poll() is None and time.monotonic() < deadline:
        proc.send_signal(signal.SIGINT)  # a user hammering Ctrl-C
        time.sleep(0.01)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    trace = read_trace(tmp_path / "t.trace")
    assert trace.meta.status == "interrupted"
    assert trace.meta.steps_completed >= 1


def test_steps_are_obeyed_when_a_bare_except_swallows_the_stop(tmp_path):
    script = _script(tmp_path, '''
        while True:
            try:
                step()
            except:  # noqa: E722 - the point of the test
                pass
    ''')
    proc = _profile(tmp_path, script, "--steps", "3")
    assert proc.returncode == 0, proc.stderr
    assert "caught the stop" in proc.stderr
    trace = read_trace(tmp_path / "t.trace")
    assert (trace.meta.status, trace.meta.steps_completed) == ("completed", 3)


def test_a_forked_child_is_terminated_by_sigterm_not_by_the_profiler(tmp_path):
    script = _script(tmp_path, '''
        import multiprocessing
        def sleeper():
            time.sleep(60)
        step()
        child = multiprocessing.get_context("fork").Process(target=sleeper)
        child.start()
        time.sleep(0.5)
        child.terminate()
        child.join()
        print("child exit code", child.exitcode, flush=True)
        step()
    ''')
    proc = _profile(tmp_path, script, "--steps", "5")
    assert proc.returncode == 0, proc.stderr
    assert f"child exit code {-signal.SIGTERM}" in proc.stdout
    assert "Traceback" not in proc.stderr


def test_checkpoints_cost_at_most_an_allowance_plus_a_fraction_of_the_run():
    now = [0.0]
    point = checkpoint_module.Checkpoint(Path("unused"), "s.py", [], clock=lambda: now[0])
    spent = 0.0
    for _ in range(2000):  # a step every 10 ms, a checkpoint costing 50 ms
        now[0] += 0.01
        if point.due():
            point.spent_s += 0.05
            point._last_cost_s = 0.05
            now[0] += 0.05
            spent += 0.05
    elapsed = now[0]
    assert spent <= checkpoint_module.FREE_ALLOWANCE_S \
        + checkpoint_module.TIME_FRACTION * elapsed + 0.05
    assert spent >= checkpoint_module.FREE_ALLOWANCE_S  # the allowance is used: early steps kept


def test_a_relative_output_stays_where_the_user_was_when_the_script_chdirs(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    script = _script(tmp_path, f'''
        os.makedirs({str(elsewhere)!r}, exist_ok=True)
        os.chdir({str(elsewhere)!r})
        for i in range(3):
            step()
    ''')
    argv = [sys.executable, "-m", "memadvisor.cli", "profile", str(script), "-o", "rel.trace",
            "-q", "--steps", "5"]
    proc = subprocess.run(argv, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(CHECKOUT)},
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert read_trace(tmp_path / "rel.trace").meta.steps_completed == 3
    assert not (elsewhere / "rel.trace").exists()


def test_an_unwritable_output_is_refused_before_the_script_runs(tmp_path):
    marker = tmp_path / "ran"
    script = _script(tmp_path, f'''
        open({str(marker)!r}, "w").close()
        step()
    ''')
    (tmp_path / "a_folder").mkdir()
    for output in ("a_folder", f"{script}/under_a_file.trace", "x" * 300 + ".trace"):
        proc = subprocess.run(
            [sys.executable, "-m", "memadvisor.cli", "profile", str(script), "-o", output],
            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(CHECKOUT)},
            capture_output=True, text=True, timeout=240)
        assert proc.returncode == 2, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert not marker.exists()


def test_apply_on_a_read_only_filesystem_is_one_line_and_leaves_the_script(tmp_path,
                                                                         monkeypatch, capsys):
    import errno
    import tempfile

    from memadvisor.cli import main
    script = _script(tmp_path, "step()\n")
    before = script.read_text()

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(tmp_path))
    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    assert main(["apply", str(script), "--plan", "precision=bf16", "-q", "--in-place"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("could not write (read-only filesystem)"), err
    assert len(err.splitlines()) == 1
    assert script.read_text() == before
