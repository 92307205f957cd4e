"""`simulate --verify` / `advise --verify`: a plan executed as `apply` runs it.

The script is profiled for real on the CPU, then each plan is executed: on fake tensors on
a simulated GPU (several ranks on a fake process group), or for real on this CPU.  The
executed figures are checked against independent runs of the same thing (a plain
`profile --fake` of the script, `apply --profile`), and against what the plan must change.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from memadvisor.plan import Plan
from memadvisor.verify import apply_refusals
from memadvisor.verify.script import RecordedScript, in_user_terms

CHECKOUT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent('''
    import argparse
    import torch
    import torch.nn as nn

    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(),
                          nn.Linear(1024, 16)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        x = torch.randn(args.batch_size, 256, device=device)
        y = torch.randn(args.batch_size, 16, device=device)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step} loss {loss.item():.4f}")
''')

needs_compiler = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                    reason="fake execution on a GPU needs a C++ compiler")


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(CHECKOUT)}
    env.pop("CUBLAS_WORKSPACE_CONFIG", None)
    return subprocess.run([sys.executable, "-m", "memadvisor.cli", *args], capture_output=True,
                          text=True, timeout=300, cwd=cwd, env=env)


def profile_script(folder: Path) -> Path:
    """SCRIPT written into ``folder`` and profiled there (3 steps, batch 8) as train.trace."""
    (folder / "train.py").write_text(SCRIPT)
    proc = _cli("profile", "train.py", "-o", "train.trace", "--steps", "3", "-q", "--",
                "--batch-size", "8", cwd=folder)
    assert proc.returncode == 0, proc.stderr
    return folder


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    return profile_script(tmp_path_factory.mktemp("verify"))


def _simulate(folder: Path, plan: str, *options: str) -> dict:
    proc = _cli("simulate", "train.trace", "--plan", plan, "--verify", "--json", *options,
                cwd=folder)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@needs_compiler
def test_executed_on_a_simulated_gpu_equals_a_fake_profile_of_the_script(profiled):
    data = _simulate(profiled, "none", "--gpu", "a100-40gb")
    record = data["verification"]
    assert record["method"] == "fake" and record["executed"]
    assert [r["rank"] for r in record["ranks"]] == [0]
    # the same script profiled by `profile --fake` (no rewrite): its last step's peaks
    proc = _cli("profile", "--fake", "--gpu", "a100-40gb", "train.py", "-o", "plain.trace",
                "--steps", "3", cwd=profiled)
    assert proc.returncode == 0, proc.stderr
    from memadvisor.commands.profile_fake import modelled_step_peaks
    steps, _ = modelled_step_peaks(profiled / "plain.trace", "cuda:0")
    last = [s for s in steps if s.step == 2][0]
    assert record["executed_allocated_bytes"] == last.peak_allocated_bytes
    assert record["executed_reserved_bytes"] == last.peak_reserved_bytes
    # the analytic prediction and the executed one are both in the output
    assert record["analytic_peak_bytes"] == data["reserved_bytes"]
    assert record["difference"] == pytest.approx(
        (data["reserved_bytes"] - last.peak_reserved_bytes) / last.peak_reserved_bytes)


@needs_compiler
def test_sharding_really_shards_on_every_executed_rank(profiled):
    whole = _simulate(profiled, "none", "--gpu", "a100-40gb")["verification"]
    sharded = _simulate(profiled, "shard=zero3,world=4", "--gpu", "a100-40gb")["verification"]
    assert sharded["executed"], sharded
    # rank 0 and the last by default: each on its own GPU of a 4-rank fake group
    assert [r["rank"] for r in sharded["ranks"]] == [0, 3]
    parameters = 4 * (256 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 16 + 16)
    # parameters, gradients and two Adam moments: 4x the parameters unsharded; a quarter of
    # that per rank under zero3 (plus a gathered layer or two at a time)
    saved = whole["executed_allocated_bytes"] - sharded["executed_allocated_bytes"]
    assert saved > 0.5 * 4 * parameters * 3 / 4, (whole, sharded)


@needs_compiler
def test_chosen_ranks_and_a_rank_outside_the_world(profiled):
    data = _simulate(profiled, "shard=zero2,world=2", "--gpu", "a100-40gb", "--rank", "1")
    assert [r["rank"] for r in data["verification"]["ranks"]] == [1]
    proc = _cli("simulate", "train.trace", "--plan", "shard=zero2,world=2", "--gpu",
                "a100-40gb", "--verify", "--rank", "2", cwd=profiled)
    assert proc.returncode == 2 and "rank 2 is not a rank of the plan's world=2" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_on_the_cpu_the_plan_runs_for_real_as_apply_profile_measures_it(profiled):
    data = _simulate(profiled, "accum=2")
    record = data["verification"]
    assert record["method"] == "real" and record["executed"], record
    assert record["executed_reserved_bytes"] is None
    proc = _cli("apply", "train.py", "--plan", "accum=2", "-q", "-o", "applied.py",
                "--profile", "applied.trace", "--profile-steps", "3", cwd=profiled)
    assert proc.returncode == 0, proc.stderr
    from memadvisor.trace.io import read_trace
    measured = read_trace(profiled / "applied.trace").meta.steps[2]["peak_bytes"]
    # two real runs of one plan: equal but for allocations whose timing varies (none here)
    assert record["executed_peak_bytes"] == pytest.approx(measured, rel=0.002)
    # accumulation halves the activations: below the unmodified peak
    assert record["executed_peak_bytes"] < data["baseline_peak_bytes"]
    # the hidden copy is gone; the user's folder holds what it held plus our own files
    assert not list(profiled.glob(".train_memadvisor_verify_*"))


def test_a_script_that_moved_is_one_line(profiled, tmp_path):
    shutil.copy(profiled / "train.trace", tmp_path / "moved.trace")
    from memadvisor.trace.io import read_meta
    meta = read_meta(tmp_path / "moved.trace")
    assert meta.script.endswith("train.py")
    os.rename(profiled / "train.py", profiled / "train_gone.py")
    try:
        proc = _cli("simulate", "moved.trace", "--plan", "accum=2", "--verify", cwd=tmp_path)
    finally:
        os.rename(profiled / "train_gone.py", profiled / "train.py")
    assert proc.returncode == 2
    assert "is not there any more" in proc.stderr and "Traceback" not in proc.stderr


def test_plans_apply_cannot_realise_are_named_before_anything_runs(tmp_path):
    closure = textwrap.dedent('''
        import torch
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.LBFGS(model.parameters())
        x, y = torch.randn(8, 4), torch.randn(8, 1)
        for _ in range(2):
            def closure():
                optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                return loss
            optimizer.step(closure)
    ''')
    script = RecordedScript(path=tmp_path / "lbfgs.py", args=[], cwd=tmp_path, source=closure)
    refused = apply_refusals(script, [Plan.parse("accum=2")])
    # LBFGS re-evaluates the closure: no micro-batch split can happen inside it
    assert list(refused) == ["accum=2"] and refused["accum=2"]


def test_messages_name_the_users_lines_not_the_hidden_copy(tmp_path):
    original = "import torch\nx = 1\nfor i in range(3):\n    y = x + i\nprint(y)\n"
    rewritten = ("import torch\nimport memadvisor.apply as mem\nx = 1\nfor i in range(3):\n"
                 "    for _ in mem.micro_batches():\n        y = x + i\nprint(y)\n")
    script = RecordedScript(path=tmp_path / "t.py", args=[], cwd=tmp_path, source=original)
    copy = tmp_path / ".t_memadvisor_verify_ab12.py"
    assert in_user_terms(f"error at {copy}:7", copy, script, rewritten) == \
        f"error at {script.path}:5"
    assert in_user_terms(f"{copy.name}:6 read", copy, script, rewritten) == \
        f"{script.path}:4 read"  # re-indented by the micro-batch loop: still the user's line
    assert in_user_terms(f"at {copy}:5", copy, script, rewritten) == \
        f"at {script.path} (line 5 of the rewritten script)"


def test_a_freed_core_goes_to_the_costliest_waiting_run():
    import threading
    import time

    from memadvisor.verify.execute import ChildSlots, plan_cost
    assert plan_cost(Plan(accum=8)) > plan_cost(Plan(checkpoint="auto")) > plan_cost(Plan())
    slots = ChildSlots(1)
    started: list[float] = []
    holding = slots.slot(0.0)
    holding.__enter__()

    def run(cost: float) -> None:
        with slots.slot(cost):
            started.append(cost)

    threads = [threading.Thread(target=run, args=(cost,)) for cost in (1.0, 8.0, 4.0)]
    for thread in threads:
        thread.start()
    while len(slots._waiting) < 3:
        time.sleep(0.01)
    holding.__exit__(None, None, None)
    for thread in threads:
        thread.join()
    assert started == [8.0, 4.0, 1.0]


def test_a_run_queued_behind_a_reserved_one_starts_beside_it():
    import threading
    import time

    from memadvisor.verify.execute import ChildSlots
    slots = ChildSlots(2)
    slots.reserve(("accum=8", 0), 8.0)
    slots.reserve(("accum=4", 0), 4.0)
    both_running = threading.Barrier(2, timeout=30)

    def run(key, cost):
        with slots.slot(cost, key):
            both_running.wait()  # breaks (raises) unless the two hold a core at once

    cheaper = threading.Thread(target=run, args=(("accum=4", 0), 4.0))
    cheaper.start()  # waits: the costlier reserved run is first in line
    time.sleep(0.2)
    run(("accum=8", 0), 8.0)
    cheaper.join()
    slots.cancel([("accum=8", 0), ("accum=4", 0)])
