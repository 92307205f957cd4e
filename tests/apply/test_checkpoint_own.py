"""A script that checkpoints its own blocks (``torch.utils.checkpoint`` in its forward, as
HF's ``gradient_checkpointing_enable()`` or timm's ``set_grad_checkpointing()`` do) under
``checkpoint=auto``: the blocks are left as the script runs them -- not checkpointed a
second time inside its checkpoint -- one line names the script's line, and the plan's
evidence holds (it stopped after one step saying "did not take effect", issue #12)."""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from memadvisor.apply import checks
from memadvisor.apply.checkpointing import apply_checkpointing
from memadvisor.plan import Plan

WIDTH, LAYERS = 32, 3


class Block(nn.Module):
    runs = 0  #: forwards run, first runs and recomputes

    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        Block.runs += 1
        return x + self.fc(torch.tanh(self.ln(x)))


class SelfCheckpointing(nn.Module):
    def __init__(self, reentrant: bool | None = False):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, 4)
        self.reentrant = reentrant  # None: the script does not checkpoint

    def forward(self, x):
        for block in self.blocks:
            if self.reentrant is None:
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.reentrant)  # the script's line
        return self.head(x)


def _one_step(model, plan="checkpoint=auto"):
    evidence = checks.Evidence()
    chosen = apply_checkpointing(model, Plan.parse(plan), evidence)
    Block.runs = 0
    x = torch.randn(8, WIDTH, requires_grad=True)
    F.cross_entropy(model(x), torch.randint(4, (8,))).backward()
    missing = checks.missing_knob(Plan.parse(plan), evidence, model, "SelfCheckpointing", 1, 1)
    return chosen, evidence, missing


def test_blocks_the_script_checkpoints_run_once_and_recompute_once(capsys):
    chosen, evidence, missing = _one_step(SelfCheckpointing(reentrant=False))
    assert chosen == ["blocks.0", "blocks.1", "blocks.2"]
    # checkpointed inside the script's checkpoint they ran three times or more each
    assert Block.runs == 2 * LAYERS
    assert evidence.checkpointed_forwards == LAYERS and evidence.recomputes == LAYERS
    assert missing is None
    err = capsys.readouterr().err
    assert err.count("already checkpointed by the script") == 1, err
    assert "blocks.0 (Block)" in err and "test_checkpoint_own.py:" in err
    assert "x = checkpoint(block, x, use_reentrant=self.reentrant)" in err


def test_the_reentrant_form_too(capsys):
    chosen, evidence, missing = _one_step(SelfCheckpointing(reentrant=True))
    assert Block.runs == 2 * LAYERS
    assert evidence.checkpointed_forwards == LAYERS and evidence.recomputes == LAYERS
    assert missing is None
    assert "already checkpointed by the script" in capsys.readouterr().err


def test_a_model_that_does_not_checkpoint_itself_is_checkpointed_by_the_plan(capsys):
    chosen, evidence, missing = _one_step(SelfCheckpointing(reentrant=None))
    assert Block.runs == 2 * LAYERS  # the plan's own checkpoint: a run and a recompute
    assert evidence.checkpointed_forwards == LAYERS and evidence.recomputes == LAYERS
    assert missing is None
    assert "already checkpointed" not in capsys.readouterr().err


def test_modules_outside_the_scripts_checkpoint_are_still_checkpointed(capsys):
    model = SelfCheckpointing(reentrant=False)
    calls = []
    original = model.head.forward
    model.head.forward = lambda x: calls.append(torch.is_grad_enabled()) or original(x)
    chosen, evidence, missing = _one_step(model, "checkpoint=head")
    assert chosen == ["head"]
    assert len(calls) == 2  # the head's forward and its recompute under the plan
    assert "already checkpointed" not in capsys.readouterr().err
