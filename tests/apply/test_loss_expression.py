"""pp with a loss the script computes: the rewrite moves the loss expression into the
pipeline's loss function (apply/loss_expression.py), keeps a loss the model returns as it
was, and refuses what cannot move, naming the line."""
import textwrap

import pytest
import torch
from torch import nn

from apply_runs import EXAMPLES, REPO
from memadvisor.apply import pipeline_loss
from memadvisor.apply.rewrite import RewriteError, rewrite_source
from memadvisor.plan import Plan

PP = Plan.parse("pp=2,world=2")

HEAD = """\
import torch
import torch.nn as nn
import torch.nn.functional as F

model = Net()
criterion = nn.CrossEntropyLoss()
optimizer = torch.optim.AdamW(model.parameters())
for step in range(3):
    x, y = batch()
"""


def _rewrite(body: str, plan: Plan = PP) -> str:
    source = HEAD + textwrap.indent(textwrap.dedent(body), "    ")
    return rewrite_source(source, plan, "train.py").code


def _loop(code: str) -> str:
    return code[code.index("for step"):]


def test_llama_decoder_loss_becomes_the_loss_function():
    source = (REPO / "zoo" / "llama_decoder.py").read_text()
    rewrite = rewrite_source(source, PP, "llama_decoder.py")
    loop = rewrite.code[rewrite.code.index("for inputs, labels in mem.micro_batches"):]
    assert loop.splitlines()[1:6] == [
        "            def memadvisor_loss(logits, labels):",
        "                loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), "
        "labels.reshape(-1))",
        "                return loss",
        "            loss = mem.with_loss(model, memadvisor_loss, labels)(inputs)",
        "            mem.backward(loss)"]
    assert "pipeline's loss function" in rewrite.found["loss"]
    compile(rewrite.code, "llama_decoder_memadvisor.py", "exec")


@pytest.mark.parametrize("body, function, call", [
    # the common forms: a criterion module on the call, a function on a named output, a
    # loss assembled over several statements
    ("loss = criterion(model(x), y)\nloss.backward()\noptimizer.step()\n",
     ["def memadvisor_loss(memadvisor_output, y):",
      "    loss = criterion(memadvisor_output, y)", "    return loss"],
     "loss = mem.with_loss(model, memadvisor_loss, y)(x)"),
    ("out = model(x)\nloss = F.cross_entropy(out.view(-1, 16), y.view(-1))\nloss.backward()\n"
     "optimizer.step()\n",
     ["def memadvisor_loss(out, y):",
      "    loss = F.cross_entropy(out.view(-1, 16), y.view(-1))", "    return loss"],
     "loss = mem.with_loss(model, memadvisor_loss, y)(x)"),
    ("logits, aux = model(x)\nce = criterion(logits, y)\nloss = ce + 0.1 * aux\n"
     "loss *= 0.5\nloss.backward()\noptimizer.step()\n",
     ["def memadvisor_loss(memadvisor_output, y):",
      "    logits, aux = memadvisor_output", "    ce = criterion(logits, y)",
      "    loss = ce + 0.1 * aux", "    loss *= 0.5", "    return loss"],
     "loss = mem.with_loss(model, memadvisor_loss, y)(x)"),
])
def test_script_side_losses_move_into_the_loss_function(body, function, call):
    code = _rewrite(body)
    lines = [l[8:] for l in _loop(code).splitlines()[3:]]  # inside the micro-batch loop
    assert lines[:len(function) + 1] == [*function, call]
    assert "mem.backward(loss)" in code
    compile(code, "train.py", "exec")


def test_a_loss_the_model_returns_keeps_the_plain_call():
    rewrite = rewrite_source((EXAMPLES / "gpt_lm.py").read_text(), PP, "gpt_lm.py")
    assert "with_loss" not in rewrite.code and "_, loss = model(x, y)" in rewrite.code
    code = _rewrite("with torch.autocast('cpu'):\n    _, loss = model(x, y)\nloss.backward()\n"
                    "optimizer.step()\n")
    assert "with_loss" not in code


def test_a_with_block_around_forward_and_loss_is_entered_by_the_pipeline():
    """The autocast pattern (nanoGPT's ``with ctx:``): the loss function keeps the block,
    and ``context=`` hands it to the pipeline for every stage's forward."""
    code = _rewrite("with torch.autocast('cpu'):\n    logits, loss = model(x, y)\n"
                    "    loss = loss / 4\nloss.backward()\noptimizer.step()\n")
    lines = [l[8:] for l in _loop(code).splitlines()[3:9]]
    assert lines == ["def memadvisor_loss(memadvisor_output):",
                     "    with torch.autocast('cpu'):",
                     "        logits, loss = memadvisor_output",
                     "        loss = loss / 4",
                     "    return loss",
                     "loss = mem.with_loss(model, memadvisor_loss, "
                     "context=lambda: torch.autocast('cpu'))(x, y)"]
    compile(code, "train.py", "exec")


def test_without_pp_the_rewrite_is_unchanged():
    code = _rewrite("loss = criterion(model(x), y)\nloss.backward()\noptimizer.step()\n",
                    Plan.parse("accum=2"))
    assert "with_loss" not in code and "loss = criterion(model(x), y)" in code


@pytest.mark.parametrize("body, line, words", [
    ("logits = model(x)\nloss = criterion(logits, y)\nloss.backward()\noptimizer.step()\n"
     "acc = (logits.argmax(-1) == y).float().mean()\n",
     14, "reads `logits`, which the loss expression .* computes"),
    ("logits = model(x)\nloss = criterion(logits, y)\ntotal += loss.item()\nloss.backward()\n"
     "optimizer.step()\n", 12, "updates `total`, made before the model call"),
    ("logits = model(x)\nloss = criterion(logits, y) + model.aux_loss\nloss.backward()\n"
     "optimizer.step()\n", 11, "reads `model.aux_loss`, the model itself"),
    ("logits = model(x)\nprint(logits.shape)\nloss = criterion(logits, y)\nloss.backward()\n"
     "optimizer.step()\n", 11, "`print\\(logits.shape\\)` .* is not an assignment"),
    ("logits = model(x)\nstats['loss'] = loss = criterion(logits, y)\nloss.backward()\n"
     "optimizer.step()\n", 11, "assigns to an attribute or item"),
    ("with torch.autocast('cpu') as cast:\n    logits = model(x)\n"
     "    loss = criterion(logits, y)\nloss.backward()\noptimizer.step()\n", 10,
     "called inside a `with` block"),
    ("if step > 0:\n    logits = model(x)\n    loss = criterion(logits, y)\n"
     "loss.backward()\noptimizer.step()\n", 10, "called inside a `if` block"),
    ("criterion(model(x), y).backward()\noptimizer.step()\n", 10,
     "calls the model and the backward in one expression; assign the loss to a name"),
])
def test_a_loss_expression_that_cannot_be_pipelined_is_refused_naming_its_line(body, line,
                                                                               words):
    with pytest.raises(RewriteError, match=words) as caught:
        _rewrite(body)
    message = str(caught.value)
    assert f"line {line}" in message and "pp (world=2,pp=2)" in message, message
    assert "\n" not in message and "nothing was written or run" in message


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x)


def test_with_loss_outside_a_pipeline_is_the_loss_of_the_output():
    """A script rewritten for pp and switched to another plan runs the same math."""
    torch.manual_seed(0)
    model, x, y = _Net(), torch.randn(6, 4), torch.randint(3, (6,))

    def loss_fn(output, y):
        return nn.functional.cross_entropy(output, y)
    expected = loss_fn(model(x), y)
    assert torch.equal(pipeline_loss.with_loss(model, loss_fn, y)(x), expected)
    assert torch.equal(pipeline_loss.with_loss(model.forward, loss_fn, y)(x), expected)
    entered = []

    class Context:
        def __enter__(self):
            entered.append(torch.is_grad_enabled())

        def __exit__(self, *exc):
            return False
    assert torch.equal(pipeline_loss.with_loss(model, loss_fn, y, context=Context)(x),
                       expected)
    assert entered == [True]
