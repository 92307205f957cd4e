"""The real command line, in subprocesses: scripts nobody here wrote, bad input, Ctrl-C,
timeouts, and ``memadvisor summary``.

Every profile run pays for importing torch (seconds), so the module starts all of them at
once (a few at a time) the first time a test needs one, and each test reads its result.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from memadvisor.trace import read_trace

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = REPO_ROOT / "tests" / "fixtures" / "scripts"
PACKAGE_DIR = REPO_ROOT / "memadvisor"
RUN_TIMEOUT_S = 300
PARALLEL_RUNS = 4

OWN_FLAGS_ARGS = ["--batch-size", "8", "--hidden", "16", "--verbose", "--steps-per-epoch", "2",
                  "--epochs", "3"]


@dataclass
class Run:
    argv: list[str]
    cwd: Path
    returncode: int
    stdout: str
    stderr: str
    trace_path: Path
    wall_s: float

    def trace(self):
        assert self.trace_path.exists(), f"no trace written; stderr:\n{self.stderr}"
        return read_trace(self.trace_path)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    # the checkout under test, whatever is installed
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return env


def memadvisor(*args: str, cwd: Path = REPO_ROOT, timeout: float = RUN_TIMEOUT_S):
    return subprocess.run([sys.executable, "-m", "memadvisor.cli", *args], cwd=cwd,
                          env=_env(), capture_output=True, text=True, timeout=timeout)


def _profile(out_dir: Path, name: str, script: Path, *options: str, script_args=(),
             cwd: Path = REPO_ROOT, output: str | None = None, quiet: bool = True) -> Run:
    trace_path = out_dir / f"{name}.trace"
    argv = ["profile", str(script), "-o", output or str(trace_path), "--steps", "3",
            *(["-q"] if quiet else []), *options]
    if script_args:
        argv += ["--", *script_args]
    started = time.perf_counter()
    result = memadvisor(*argv, cwd=cwd)
    return Run(argv, cwd, result.returncode, result.stdout, result.stderr,
               cwd / output if output else trace_path, time.perf_counter() - started)


def _interrupted(out_dir: Path) -> Run:
    """until_converged with --steps 0 runs forever: Ctrl-C it once it is training."""
    trace_path = out_dir / "interrupted.trace"
    argv = ["profile", str(SCRIPTS / "until_converged.py"), "-o", str(trace_path),
            "--steps", "0", "-q"]
    started = time.perf_counter()
    # Ctrl-C as a terminal delivers it: SIGINT at its default even where this test run
    # inherited it ignored (a background job of a non-interactive shell, runuser)
    process = subprocess.Popen([sys.executable, "-m", "memadvisor.cli", *argv], cwd=REPO_ROOT,
                               env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, preexec_fn=lambda: signal.signal(
                                   signal.SIGINT, signal.SIG_DFL))
    # the script prints (flushed) every 100 steps: once a line arrives it is in its loop,
    # past torch's import, so the signal lands in the training loop (~4 s on an idle box)
    first_line = process.stdout.readline()
    process.send_signal(signal.SIGINT)
    try:
        stdout, stderr = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        stdout, stderr = process.communicate()
        stderr += "\n[test] still running 60 s after SIGINT: killed"
    return Run(argv, REPO_ROOT, process.returncode, first_line + stdout, stderr, trace_path,
               time.perf_counter() - started)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    out = tmp_path_factory.mktemp("cli")
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    jobs = {
        "plain_loop": lambda: _profile(out, "plain_loop", SCRIPTS / "plain_loop.py"),
        "own_flags": lambda: _profile(out, "own_flags", SCRIPTS / "own_flags.py",
                                      script_args=OWN_FLAGS_ARGS),
        "manual_sgd": lambda: _profile(out, "manual_sgd", SCRIPTS / "manual_sgd.py"),
        "until_converged": lambda: _profile(out, "until_converged",
                                            SCRIPTS / "until_converged.py"),
        "grad_accum": lambda: _profile(out, "grad_accum", SCRIPTS / "grad_accum.py"),
        # run from another folder, with a relative -o: the trace lands in that folder
        "uses_file_relative": lambda: _profile(out, "uses_file_relative",
                                               SCRIPTS / "uses_file_relative.py",
                                               cwd=elsewhere, output="relative.trace"),
        "missing": lambda: _profile(out, "missing", SCRIPTS / "no_such_script.py"),
        "directory": lambda: _profile(out, "directory", SCRIPTS),
        "syntax_error": lambda: _profile(out, "syntax_error", SCRIPTS / "syntax_error.py"),
        "crash_at_import": lambda: _profile(out, "crash_at_import",
                                            SCRIPTS / "crash_at_import.py"),
        "crash_in_step": lambda: _profile(out, "crash_in_step", SCRIPTS / "crash_in_step.py"),
        "never_steps": lambda: _profile(out, "never_steps", SCRIPTS / "never_steps.py",
                                        "--timeout", "2"),
        "interrupted": lambda: _interrupted(out),
        # the script's own --steps 2, after `--`, is not memadvisor's --steps 3
        "script_steps": lambda: _profile(out, "script_steps",
                                         REPO_ROOT / "examples" / "mlp_regressor.py",
                                         script_args=["--steps", "2", "--log-every", "1"]),
        # not quiet: its progress lines are checked
        "gpt_lm": lambda: _profile(out, "gpt_lm", REPO_ROOT / "examples" / "gpt_lm.py",
                                   quiet=False),
    }
    started = time.perf_counter()
    with ThreadPoolExecutor(PARALLEL_RUNS) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        results = {name: future.result() for name, future in futures.items()}
    print(f"\n{len(results)} memadvisor runs in {time.perf_counter() - started:.1f} s: " +
          ", ".join(f"{name} {run.wall_s:.1f}s" for name, run in results.items()))
    return results


def _ok(run: Run):
    assert run.returncode == 0, run.stderr
    trace = run.trace()
    assert trace.meta.status == "completed", trace.meta.error
    assert trace.meta.error == ""
    assert "Traceback" not in run.stderr
    return trace


def _one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


def _alive_at_end(trace, category: str) -> tuple[int, int]:
    """(bytes, storages) of ``category`` alive after the last event."""
    events = trace.events
    of = events[events["category"].astype(str) == category]
    made = of[of["action"] == "alloc"].set_index("storage_id")["size_bytes"]
    gone = set(of[of["action"] == "free"]["storage_id"])
    alive = made[~made.index.isin(gone)]
    return int(alive.sum()), len(alive)


def _assert_model_state(trace, optimizer_state_per_parameter: str) -> None:
    """Parameters, gradients and optimizer state against what the algorithm implies:
    ``"adam"`` two moments plus a 4-byte step per tensor, ``"rmsprop"`` one average plus
    a step, ``"none"`` nothing (plain SGD)."""
    parameter_bytes, tensors = _alive_at_end(trace, "parameter")
    assert parameter_bytes == trace.meta.parameter_bytes
    expected = {"adam": 2 * parameter_bytes + 4 * tensors,
                "rmsprop": parameter_bytes + 4 * tensors,
                "none": 0}[optimizer_state_per_parameter]
    assert _alive_at_end(trace, "optimizer_state")[0] == expected
    assert trace.meta.optimizers[0]["state_bytes"] == expected
    # every parameter has its gradient at the optimizer step, in every step
    events = trace.events
    signed = np.where(events["action"].astype(str) == "alloc", 1, -1) * events["size_bytes"]
    gradient = np.cumsum(np.where(events["category"].astype(str) == "gradient", signed, 0))
    steps = events["step"].to_numpy()
    for step in range(trace.meta.steps_completed):
        assert int(gradient[steps == step].max()) == parameter_bytes, step


def _linear_bytes(*shapes: tuple[int, int]) -> int:
    """float32 bytes of Linear layers (in, out) with biases."""
    return 4 * sum(i * o + o for i, o in shapes)


# --- scripts nobody here wrote ----------------------------------------------------------
def test_plain_loop(runs):
    trace = _ok(runs["plain_loop"])
    assert trace.meta.steps_completed == 3
    assert trace.meta.step_detection == "optimizer"
    assert trace.meta.parameter_bytes == _linear_bytes((20, 64), (64, 64), (64, 1))
    assert trace.meta.optimizers[0]["class"] == "SGD"
    assert trace.meta.script == str(SCRIPTS / "plain_loop.py")
    _assert_model_state(trace, "none")


def test_plain_loop_batch_is_the_models_input(runs):
    """The DataLoader's (32, 20) inputs, not the (32, 1) outputs the loss module gets."""
    batch = runs["plain_loop"].trace().meta.batch
    assert batch["batch_size"] == 32
    assert batch["shapes"][0] == [32, 20]


def test_own_flags_reach_the_script(runs):
    run = runs["own_flags"]
    trace = _ok(run)
    assert "  step 1 loss=" in run.stdout  # --verbose got through
    assert "epoch 0:" in run.stdout  # two steps per epoch: the third step is in epoch 1
    assert trace.meta.steps_completed == 3
    # --hidden 16 got through: 784 -> 16 -> 5
    assert trace.meta.parameter_bytes == _linear_bytes((28 * 28, 16), (16, 5))
    assert trace.meta.argv[1:] == OWN_FLAGS_ARGS
    _assert_model_state(trace, "adam")
    assert trace.meta.batch["shapes"][0] == [8, 1, 28, 28]


def test_flags_after_the_separator_belong_to_the_script(runs):
    run = runs["script_steps"]
    trace = _ok(run)
    assert trace.meta.steps_requested == 3
    assert trace.meta.steps_completed == 2  # the script ended after its own 2 steps
    assert "step     2 |" in run.stdout
    assert "step     3 |" not in run.stdout
    assert trace.meta.argv[1:] == ["--steps", "2", "--log-every", "1"]


def test_manual_sgd_counts_backward_passes(runs):
    trace = _ok(runs["manual_sgd"])
    assert trace.meta.step_detection == "backward"
    # auto mode waits a few extra backwards for an optimizer step that never comes, but
    # it stops long before the script's 20 iterations
    assert 3 <= trace.meta.steps_completed < 20
    assert trace.meta.optimizers == []
    # w1 (16x32), b1 (32), w2 (32x1), b2 (1): trainable leaves, updated in place
    expected = 4 * (16 * 32 + 32 + 32 + 1)
    events = trace.events
    signed = np.where(events["action"].astype(str) == "alloc", 1, -1) * events["size_bytes"]
    assert int(signed[events["category"].astype(str) == "parameter"].sum()) == expected


def test_manual_sgd_metadata_counts_its_trainable_tensors(runs):
    trace = runs["manual_sgd"].trace()
    assert trace.meta.parameter_bytes == 4 * (16 * 32 + 32 + 32 + 1)
    assert trace.meta.parameter_count == 16 * 32 + 32 + 32 + 1


def test_until_converged_stops_after_three_steps(runs):
    trace = _ok(runs["until_converged"])
    assert trace.meta.steps_completed == 3
    assert trace.meta.step_detection == "optimizer"


def test_grad_accum_steps_at_the_optimizer(runs):
    trace = _ok(runs["grad_accum"])
    assert trace.meta.steps_completed == 3
    assert trace.meta.step_detection == "optimizer"
    events = trace.events
    for step in range(3):
        phases = events[events["step"] == step]["phase"].astype(str).tolist()
        runs_of = [p for i, p in enumerate(phases) if i == 0 or phases[i - 1] != p]
        # accum_steps=2: two forward+backward pairs, then one optimizer step
        assert runs_of.count("forward") == 2, (step, runs_of)
        assert runs_of.count("backward") == 2, (step, runs_of)
        assert runs_of[-1] == "optimizer", (step, runs_of)
    # the second micro-batch accumulates into the gradients in place: never more than one
    # set of gradients alive
    _assert_model_state(trace, "adam")


def test_uses_file_relative_from_another_folder(runs):
    run = runs["uses_file_relative"]
    trace = _ok(run)
    assert "helper_mod loaded" in run.stdout
    assert f"cwd={run.cwd}" in run.stdout
    assert run.trace_path == run.cwd / "relative.trace"
    assert trace.meta.cwd == str(run.cwd)
    assert trace.meta.steps_completed == 3
    assert trace.meta.parameter_bytes == _linear_bytes((10, 48), (48, 1))
    _assert_model_state(trace, "rmsprop")


# --- bad input --------------------------------------------------------------------------
def test_missing_script(runs):
    run = runs["missing"]
    assert run.returncode == 2
    assert "no such script" in _one_line(run.stderr)
    assert not run.trace_path.exists()


def test_directory_as_script(runs):
    run = runs["directory"]
    assert run.returncode == 2
    assert "directory" in _one_line(run.stderr)


def test_syntax_error_names_file_and_line(runs):
    run = runs["syntax_error"]
    path = SCRIPTS / "syntax_error.py"
    with pytest.raises(SyntaxError) as info:
        compile(path.read_text(), str(path), "exec")
    assert run.returncode != 0
    line = _one_line(run.stderr)
    assert f"syntax_error.py:{info.value.lineno}" in line
    assert "SyntaxError" in line


def test_crash_at_import(runs):
    run = runs["crash_at_import"]
    assert run.returncode == 1
    trace = run.trace()
    assert trace.meta.status == "error"
    assert "boom" in trace.meta.error
    assert "\n" not in trace.meta.error
    assert trace.meta.steps_completed == 0
    source = (SCRIPTS / "crash_at_import.py").read_text().splitlines()
    raise_line = 1 + next(i for i, text in enumerate(source) if 'raise RuntimeError("boom' in text)
    assert re.search(rf'File "[^"]*crash_at_import\.py", line {raise_line}, in <module>',
                     run.stderr), run.stderr
    assert "RuntimeError: boom" in run.stderr
    frames = re.findall(r'File "([^"]+)"', run.stderr)
    assert frames
    assert not [f for f in frames if Path(f).resolve().is_relative_to(PACKAGE_DIR)], run.stderr


def test_crash_in_step_keeps_two_steps(runs):
    run = runs["crash_in_step"]
    assert run.returncode == 1
    trace = run.trace()
    assert trace.meta.status == "error"
    assert trace.meta.steps_completed == 2
    assert "loss check failed at step 2" in trace.meta.error
    # the failed third step's forward is in the trace
    assert (trace.events["step"] == 2).any()
    assert "crash_in_step.py" in run.stderr


def test_never_steps_times_out(runs):
    run = runs["never_steps"]
    assert run.returncode == 124, run.stderr
    trace = run.trace()
    assert trace.meta.status == "timeout"
    assert trace.meta.steps_completed == 0
    assert "2 s" in trace.meta.error
    assert "timeout" in run.stderr


def test_ctrl_c_keeps_an_interrupted_trace(runs):
    run = runs["interrupted"]
    assert run.stdout.startswith("step 100"), run.stdout + run.stderr
    assert run.returncode == 130, run.stderr
    trace = run.trace()
    assert trace.meta.status == "interrupted"
    assert trace.meta.steps_completed >= 100  # it printed after its 100th step
    assert "Traceback" not in run.stderr


def test_progress_lines_without_quiet(runs):
    run = runs["gpt_lm"]
    trace = _ok(run)
    progress = [line for line in run.stderr.splitlines() if " done; live " in line]
    assert [line.split(" done;")[0] for line in progress] == \
        [f"memadvisor: step {k}/3" for k in (1, 2, 3)]
    assert f"wrote {run.trace_path}" in run.stderr
    assert f"{len(trace):,} events, 3 steps" in run.stderr
    assert "step     1 | loss" in run.stdout  # the script's own output is untouched


# --- summary ----------------------------------------------------------------------------
def _own_peak(path: Path) -> int:
    """Peak live bytes of the last complete step, straight from the Parquet file."""
    table = pq.read_table(path, columns=["action", "size_bytes", "step"])
    done = read_trace(path).meta.steps_completed
    action = np.asarray(table.column("action").to_pylist())
    sizes = table.column("size_bytes").to_numpy()
    live = np.cumsum(np.where(action == "alloc", sizes, -sizes))
    steps = table.column("step").to_numpy()
    return int(live[steps == done - 1].max())


def test_summary_json(runs, example_runs):
    path = runs["gpt_lm"].trace_path
    result = memadvisor("summary", str(path), "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    for key in ("peak_bytes", "by_category", "steps", "parameter_bytes",
                "optimizer_state_bytes"):
        assert key in summary, key
    assert sum(summary["by_category"].values()) == summary["peak_bytes"]
    assert summary["peak_bytes"] == _own_peak(path)
    assert [s["index"] for s in summary["steps"]] == [0, 1, 2]
    # the same example profiled in-process, with torch's own view of its model state
    facts = example_runs.get("gpt_lm").facts[-1]
    assert summary["parameter_bytes"] == facts.parameter_bytes
    assert summary["optimizer_state_bytes"] == facts.optimizer_state_bytes
    assert summary["gradient_bytes"] == facts.gradient_bytes


def test_summary_text(runs):
    path = runs["gpt_lm"].trace_path
    result = memadvisor("summary", str(path))
    assert result.returncode == 0, result.stderr
    data = json.loads(memadvisor("summary", str(path), "--json").stdout)
    from memadvisor.units import format_bytes
    assert f"peak: {format_bytes(data['peak_bytes'])} in step 2" in result.stdout
    for category in data["by_category"]:
        assert category in result.stdout
    assert "activation" in data["by_category"]
    assert "examples/gpt_lm.py:" in result.stdout  # sites shown relative to the cwd


def test_summary_of_a_missing_trace(tmp_path):
    result = memadvisor("summary", str(tmp_path / "nope.trace"))
    assert result.returncode == 2
    assert "no such trace file" in _one_line(result.stderr)


def test_summary_of_a_corrupt_trace(tmp_path):
    path = tmp_path / "corrupt.trace"
    path.write_bytes(b"PAR1" + bytes(range(256)) * 8)
    result = memadvisor("summary", str(path), "--json")
    assert result.returncode == 2
    _one_line(result.stderr)
    assert result.stdout == ""


def test_help_lists_the_commands():
    result = memadvisor("--help")
    assert result.returncode == 0
    assert "profile" in result.stdout and "summary" in result.stdout
