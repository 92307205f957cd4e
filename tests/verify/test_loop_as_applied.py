"""The baseline the simulator starts from is the loop as `apply` rewrites it, asked of apply.

apply moves a ``zero_grad()`` statement found between the forward and the backward of a
raw loop in front of the micro-batch loop.  It does not move one a framework calls between
them (Lightning clears gradients after ``training_step``, before ``backward``: the zoo's
lightning_classifier ``precision=amp-bf16`` was predicted 11.2% low) nor one called from a
helper: the trace shows the same frees in all three, so only apply can tell.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from memadvisor.apply.rewrite import moves_zero_grad
from memadvisor.trace.io import read_trace
from memadvisor.verify import baseline_as_applied

CHECKOUT = Path(__file__).resolve().parents[2]

LOOP = textwrap.dedent('''
    import torch
    import torch.nn as nn

    def clear(optimizer):
        optimizer.zero_grad()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                          nn.Linear(512, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(4):
        x, y = torch.randn(32, 64), torch.randn(32, 1)
        out = model(x)
        {clear}
        loss = nn.functional.mse_loss(out, y)
        loss.backward()
        optimizer.step()
''')


def _cli(*args, cwd):
    env = {**os.environ, "PYTHONPATH": str(CHECKOUT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "memadvisor.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def test_apply_says_which_zero_grad_it_moves():
    assert moves_zero_grad(LOOP.format(clear="optimizer.zero_grad()")) is True
    assert moves_zero_grad(LOOP.format(clear="clear(optimizer)")) is False
    lightning = textwrap.dedent('''
        import lightning as L
        import torch
        class Lit(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = torch.nn.Linear(4, 1)
            def training_step(self, batch, batch_idx):
                return self.net(batch).sum()
            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)
        L.Trainer(max_steps=2).fit(Lit(), torch.utils.data.DataLoader(torch.randn(8, 4)))
    ''')
    assert moves_zero_grad(lightning) is False


@pytest.mark.parametrize("clear", ["optimizer.zero_grad()", "clear(optimizer)"])
def test_a_zero_grad_apply_leaves_in_place_is_predicted_in_place(tmp_path, clear):
    script = tmp_path / "train.py"
    script.write_text(LOOP.format(clear=clear))
    _cli("profile", str(script), "-o", "base.trace", "--steps", "3", "-q", cwd=tmp_path)
    base = baseline_as_applied(read_trace(tmp_path / "base.trace"))
    assert (base.rewritten is base.timeline) == (clear != "optimizer.zero_grad()")
    predicted = json.loads(_cli("simulate", "base.trace", "--plan", "optimizer=sgd", "--json",
                                cwd=tmp_path).stdout)["peak_bytes"]
    _cli("apply", str(script), "--plan", "optimizer=sgd", "-o", str(tmp_path / "applied.py"),
         "-q", "--profile", "applied.trace", "--profile-steps", "3", cwd=tmp_path)
    measured = read_trace(tmp_path / "applied.trace").meta.steps[-1]["peak_bytes"]
    assert abs(predicted - measured) / measured < 0.005, (predicted, measured)


def test_a_framework_plan_that_needs_cuda_is_refused_for_the_cpu_target():
    """accelerate, Lightning and the HF Trainer shard with FSDP only on CUDA: ranking such a
    plan first for a CPU target recommended a plan whose run stops at its first line."""
    from memadvisor.plan import Plan
    from memadvisor.verify import apply_refusals
    from memadvisor.verify.script import RecordedScript
    path = CHECKOUT / "zoo" / "accelerate_loop.py"
    script = RecordedScript(path=path, args=[], cwd=path.parent, source=path.read_text())
    plans = [Plan.parse("shard=zero2,world=2"), Plan.parse("accum=2")]
    assert apply_refusals(script, plans) == {}
    refused = apply_refusals(script, plans, "cpu")
    assert list(refused) == ["shard=zero2,world=2"]
    assert "needs CUDA GPUs" in refused["shard=zero2,world=2"]
    assert apply_refusals(script, plans, "cuda") == {}


def test_advise_looks_past_plans_apply_refuses(tmp_path):
    """When the plans shown are all refused for the script (accelerate's FSDP on a CPU),
    advise looks further down the ranking and shows the first one apply can realise."""
    pytest.importorskip("accelerate")
    script = CHECKOUT / "zoo" / "accelerate_loop.py"
    _cli("profile", str(script), "-o", "base.trace", "--steps", "3", "-q", cwd=tmp_path)
    peak = read_trace(tmp_path / "base.trace").meta.steps[-1]["peak_bytes"]
    env = {**os.environ, "PYTHONPATH": str(CHECKOUT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "memadvisor.cli", "advise", "base.trace",
                           "--budget", str(int(0.52 * peak)), "--gpus", "2", "--top", "2",
                           "--json"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    data = json.loads(proc.stdout)
    best = data["best"]
    assert best is not None and proc.returncode == 0, proc.stderr
    assert data["plans"][best]["apply_refused"] is None
    assert all(p["apply_refused"] for p in data["plans"][:best]) and best >= 2
    assert len(data["plans"]) == best + 1
