"""A script that moves its model to the GPU after building the optimizer (legal in PyTorch,
common in Hugging Face-style loops), verified on a simulated GPU with sharded plans.
Before: prepare went right after the optimizer, sharded the model on the CPU, and the
move left FSDP's mesh there -- the fake run failed in its first all-gather
("FakeTensorDeviceMismatchError: ... cuda:0 and cpu"), as a real run on GPUs would."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CHECKOUT = Path(__file__).resolve().parents[2]

SCRIPT = '''
import torch
from torch import nn


def main():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
                            for _ in range(3)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    {between}
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    model.to(device)
    for step in range(3):
        x = torch.randn(16, 32, device=device)
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


if __name__ == "__main__":
    main()
'''


def _cli(*args, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(CHECKOUT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "memadvisor.cli", *map(str, args)],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def _verified(tmp_path, between: str, plan: str, exit_code: int = 0) -> dict:
    script = tmp_path / "moved_late.py"
    script.write_text(SCRIPT.format(between=between))
    done = _cli("profile", script, "-o", tmp_path / "moved.trace", "--steps", "3", "-q",
                cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    done = _cli("simulate", tmp_path / "moved.trace", "--plan", plan, "--gpu", "h100-80gb",
                "--verify", "--json", cwd=tmp_path)
    assert done.returncode == exit_code, done.stderr[-2000:]
    return json.loads(done.stdout)["verification"]


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["shard=zero3,world=2", "shard=ddp,world=2"])
def test_a_model_moved_after_its_optimizer_is_sharded_on_the_gpu(tmp_path, plan):
    verification = _verified(tmp_path, "pass", plan)
    assert verification["executed"] and not verification["failed"], verification
    assert all(r["steps_completed"] == 3 for r in verification["ranks"])
    # the model's states are on the simulated GPU: sharded or not, more than the weights
    weights_bytes = 3 * (32 * 64 + 64 + 64 * 32 + 32) * 4
    assert all(r["peak_allocated_bytes"] > weights_bytes / 2 for r in verification["ranks"])


@pytest.mark.slow
def test_a_move_prepare_cannot_follow_is_named_not_crashed_on(tmp_path):
    """A scheduler built on the optimizer before the move keeps prepare after the optimizer
    (the scheduler must get the optimizer prepare returns): the run stops at its first
    forward saying what happened, instead of failing inside FSDP's all-gather."""
    verification = _verified(
        tmp_path, "scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)",
        "shard=zero3,world=2", exit_code=1)  # a plan that cannot be verified
    assert verification["failed"]
    assert "moved to cuda after mem.prepare wrapped it on cpu" in verification["failed"]
