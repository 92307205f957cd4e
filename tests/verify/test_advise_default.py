"""`advise` verifies by default where verification is fake execution (a GPU target) and the
profiled script is there; says plainly where its fits are analytic (--verify 0, the cpu
target, the script gone); `--json` says whether and how the plans were verified."""
from __future__ import annotations

import json
import os
import shutil
import textwrap
from pathlib import Path

import pytest

from memadvisor.verify.policy import DEFAULT_GPU_PLANS, choose

from .test_verify import _cli, needs_compiler, profile_script


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    return profile_script(tmp_path_factory.mktemp("advise_default"))


#: far above these small scripts' peaks: every plan fits, and so does the script as it is
BUDGET = "4GiB"


def _advise(folder: Path, *args: str, trace: str = "train.trace"):
    return _cli("advise", trace, *args, cwd=folder)


def test_the_default_count_follows_the_target_and_the_script():
    assert choose(None, "cuda", None).count == DEFAULT_GPU_PLANS == 5
    assert choose(None, "cpu", None).count == 0  # a real run per plan: asked for only
    assert choose(0, "cuda", None).count == 0 and not choose(0, "cuda", None).default
    assert choose(3, "cpu", None).count == 3
    gone = "the profiled script /x.py (recorded in t) is not there any more"
    missing = choose(None, "cuda", gone)
    assert missing.count == 0 and missing.script_missing


@needs_compiler
def test_a_gpu_target_executes_the_top_plans_by_default(profiled):
    proc = _advise(profiled, "--budget", BUDGET, "--gpu", "a100-40gb", "--objective",
                   "memory", "--top", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    record = data["plans"][0]["verification"]  # executed without --verify
    assert record["method"] == "fake" and record["executed"] and record["fits"], record
    summary = data["verification"]
    assert summary["fits_decided_by"] == "execution" and summary["default"]
    assert summary["plans_requested"] == 5 and summary["plans_executed"] == 1
    assert summary["method"] == "fake" and "simulated" in summary["where"]
    assert summary["unverified_reason"] is None and summary["known_analytic_miss"] is None
    assert summary["text"].startswith("fits: verified by execution")
    assert data["best"] == 0


@needs_compiler
def test_a_script_that_fits_as_it_is_is_executed_on_the_gpu_target(profiled):
    """A CPU trace's peak on a GPU is itself a prediction: 'change nothing' is executed."""
    proc = _advise(profiled, "--budget", BUDGET, "--gpu", "a100-40gb", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["keep_as_is"]
    assert data["baseline_verification"]["executed"] and data["baseline_verification"]["fits"]
    assert data["verification"]["subject"] == "the unmodified script"
    assert data["verification"]["fits_decided_by"] == "execution"
    assert not any("verification" in p for p in data["plans"])  # nothing else ran


def test_verify_0_says_the_fits_are_analytic_in_one_line(profiled):
    proc = _advise(profiled, "--budget", BUDGET, "--gpu", "a100-40gb", "--objective",
                   "memory", "--verify", "0")
    assert proc.returncode == 0, proc.stderr
    said = [line for line in proc.stdout.splitlines() if line.startswith("fits:")]
    assert said == [line for line in proc.stdout.splitlines() if "UNVERIFIED" in line]
    assert len(said) == 1
    assert "analytic, UNVERIFIED (--verify 0)" in said[0] and "36.5%" in said[0]
    assert "executing" not in proc.stderr and "[executed" not in proc.stdout
    proc = _advise(profiled, "--budget", BUDGET, "--gpu", "a100-40gb", "--objective",
                   "memory", "--verify", "0", "--json")
    summary = json.loads(proc.stdout)["verification"]
    assert summary["fits_decided_by"] == "analytic" and summary["plans_executed"] == 0
    assert summary["unverified_reason"] == "--verify 0" and not summary["default"]
    assert summary["known_analytic_miss"]["worst_under"] == pytest.approx(0.3651)


def test_the_cpu_target_says_its_fits_are_unverified_and_how_to_verify(profiled):
    proc = _advise(profiled, "--budget", BUDGET, "--objective", "memory", "--top", "2")
    assert proc.returncode == 0, proc.stderr
    said = [line for line in proc.stdout.splitlines() if line.startswith("fits:")]
    assert len(said) == 1 and "unverified" in said[0] and "--verify K" in said[0], said
    assert "executing" not in proc.stderr  # a real run per plan: only when asked


def test_a_moved_script_leaves_the_plans_unverified_in_one_line(profiled, tmp_path):
    """The trace moved (or the script did): by default advise goes on and says so."""
    shutil.copy(profiled / "train.trace", tmp_path / "moved.trace")
    os.rename(profiled / "train.py", profiled / "train_gone.py")
    try:
        text = _advise(tmp_path, "--budget", BUDGET, "--gpu", "a100-40gb", "--objective",
                       "memory", trace="moved.trace")
        data = _advise(tmp_path, "--budget", BUDGET, "--gpu", "a100-40gb", "--objective",
                       "memory", "--json", trace="moved.trace")
        asked = _advise(tmp_path, "--budget", BUDGET, "--gpu", "a100-40gb", "--verify", "2",
                        trace="moved.trace")
    finally:
        os.rename(profiled / "train_gone.py", profiled / "train.py")
    assert text.returncode == 0 and data.returncode == 0, text.stderr + data.stderr
    said = [line for line in text.stdout.splitlines() if "not there any more" in line]
    assert len(said) == 1 and said[0].startswith("fits: analytic, UNVERIFIED"), text.stdout
    assert "no plan was executed" in said[0] and "Traceback" not in text.stderr
    summary = json.loads(data.stdout)["verification"]
    assert summary["script_missing"] and summary["fits_decided_by"] == "analytic"
    assert "not there any more" in summary["unverified_reason"]
    # asked to verify: one line, exit 2, as before
    assert asked.returncode == 2 and "is not there any more" in asked.stderr
    assert asked.stderr.count("\n") == 1


CPU_ONLY = textwrap.dedent('''
    import torch
    import torch.nn as nn
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(3):
        x, y = torch.randn(16, 64, device="cpu"), torch.randn(16, 4)
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
''')


@needs_compiler
def test_executions_that_all_fail_leave_the_default_analytic_and_said(tmp_path):
    """A script that picks the CPU itself cannot be executed on a simulated GPU: by default
    the analytic ranking stands, labelled so; asked for (--verify K), exit 1."""
    (tmp_path / "cpu_only.py").write_text(CPU_ONLY)
    proc = _cli("profile", "cpu_only.py", "-o", "t.trace", "--steps", "3", "-q", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    common = ("--budget", BUDGET, "--gpu", "a100-40gb", "--objective", "memory", "--top",
              "1")
    proc = _advise(tmp_path, *common, "--json", trace="t.trace")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["best"] == 0 and data["plans"][0]["verification"]["failed"]
    summary = data["verification"]
    assert summary["fits_decided_by"] == "analytic" and summary["plans_attempted"] == 1
    assert summary["unverified_reason"].startswith("no plan could be executed")
    assert "UNVERIFIED" in summary["text"]
    asked = _advise(tmp_path, *common, "--verify", "1", trace="t.trace")
    assert asked.returncode == 1, asked.stdout
    last = asked.stderr.strip().splitlines()[-1]
    assert last.startswith("memadvisor: error: no plan could be executed") and "--verify 0" in last
