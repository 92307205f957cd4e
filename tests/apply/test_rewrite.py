"""The rewrite: the few edits it makes, what it keeps, and what it says when it cannot."""
import textwrap

import libcst
import pytest

from apply_runs import EXAMPLES, FIXTURES
from memadvisor.apply.rewrite import RewriteError, rewrite_source
from memadvisor.plan import Plan

PLAN = Plan.parse("precision=amp-bf16,accum=2")


def changed_lines(rewrite):
    diff = rewrite.diff().splitlines()[2:]
    removed = [l[1:].strip() for l in diff if l.startswith("-")]
    added = [l[1:].strip() for l in diff if l.startswith("+")]
    return removed, added


def test_gpt_example_diff_is_the_documented_one():
    source = (EXAMPLES / "gpt_lm.py").read_text()
    rewrite = rewrite_source(source, PLAN, "gpt_lm.py")
    removed, added = changed_lines(rewrite)
    assert removed == ["_, loss = model(x, y)", "loss.backward()",
                       "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)",
                       "optimizer.step()"]
    assert added == [
        "import memadvisor.apply as mem",
        'model, optimizer = mem.prepare(model, optimizer, plan="precision=amp-bf16,accum=2")',
        "for x, y in mem.micro_batches(x, y):",
        "_, loss = model(x, y)",
        "mem.backward(loss)",
        "mem.clip_grad_norm_(model.parameters(), 1.0)",
        "mem.step(optimizer)",
    ]
    assert rewrite.found["batch"] == "x, y"
    compile(rewrite.code, "gpt_lm_memadvisor.py", "exec")


@pytest.mark.parametrize("name", ["gpt_lm.py", "cnn_classifier.py", "mlp_regressor.py"])
def test_everything_else_is_kept_byte_for_byte(name):
    """Removing the added lines and undoing the indentation gives back the original's lines
    (comments, blank lines, formatting)."""
    source = (EXAMPLES / name).read_text()
    rewrite = rewrite_source(source, PLAN, name)
    removed, added = changed_lines(rewrite)
    assert len(added) - len(removed) <= 4  # import, prepare, for, and a moved zero_grad
    kept = [l.strip() for l in source.splitlines() if l.strip() not in removed]
    new = [l.strip() for l in rewrite.code.splitlines() if l.strip() not in added]
    assert kept == new


def test_structure_does_not_depend_on_the_plan():
    source = (EXAMPLES / "mlp_regressor.py").read_text()
    a = rewrite_source(source, Plan(), "m.py").code
    b = rewrite_source(source, Plan.parse("shard=zero3,world=2,checkpoint=auto"), "m.py").code
    assert [l for l in a.splitlines() if "plan=" not in l] == \
        [l for l in b.splitlines() if "plan=" not in l]


def test_a_rewritten_script_only_gets_its_plan_replaced():
    source = (EXAMPLES / "cnn_classifier.py").read_text()
    first = rewrite_source(source, PLAN, "cnn.py")
    again = rewrite_source(first.code, Plan.parse("shard=ddp,world=2"), "cnn.py")
    assert again.updated_plan_only
    removed, added = changed_lines(again)
    assert removed == ['model, optimizer = mem.prepare(model, optimizer, plan="precision=amp-bf16,accum=2")']
    assert added == ['model, optimizer = mem.prepare(model, optimizer, plan="shard=ddp,world=2")']
    assert rewrite_source(again.code, Plan.parse("shard=ddp,world=2"), "cnn.py").diff() == ""


def test_foreign_scripts(tmp_path):
    own_flags = rewrite_source((FIXTURES / "own_flags.py").read_text(), PLAN, "own_flags.py")
    # the model and optimizer live on self; prepare comes before the LR scheduler takes it
    assert own_flags.found["model"] == "self.model" and own_flags.found["optimizer"] == "self.opt"
    code = own_flags.code
    assert "        self.model, self.opt = mem.prepare(\n" \
           '            self.model, self.opt, plan="precision=amp-bf16,accum=2"\n        )\n' in code
    assert code.index("mem.prepare(") < code.index("StepLR(self.opt")
    assert "mem.step(self.opt)" in code
    # the script does its own accumulation: the plan's loop goes inside its inner loop
    accum = rewrite_source((FIXTURES / "grad_accum.py").read_text(), PLAN, "grad_accum.py")
    assert "for tokens, labels in mem.micro_batches(tokens, labels):" in accum.code
    assert "grad_norm = mem.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)" in accum.code
    # model-level script, DataLoader loop with tuple unpacking
    plain = rewrite_source((FIXTURES / "plain_loop.py").read_text(), PLAN, "plain_loop.py")
    assert "for inputs, targets in mem.micro_batches(inputs, targets):" in plain.code
    # forward/backward in a helper that receives model and optimizer as arguments
    helper = rewrite_source((FIXTURES / "crash_in_step.py").read_text(), PLAN, "c.py")
    assert 'model, opt = mem.prepare(model, opt, plan="precision=amp-bf16,accum=2")' in helper.code
    assert "    mem.step(opt)" in helper.code and "for x, y in mem.micro_batches(x, y):" in helper.code


def test_scripts_it_cannot_understand_are_told_why():
    with pytest.raises(RewriteError) as info:
        rewrite_source((FIXTURES / "manual_sgd.py").read_text(), PLAN, "manual_sgd.py")
    message = str(info.value)
    assert message.startswith("cannot rewrite manual_sgd.py: memadvisor did not find optimizer, step")
    assert "update parameters by hand" in message
    assert "# memadvisor: optimizer" in message
    with pytest.raises(RewriteError, match=r"never_steps.py: memadvisor did not find "
                                           r"optimizer, backward, step"):
        rewrite_source((FIXTURES / "never_steps.py").read_text(), PLAN, "never_steps.py")
    with pytest.raises(RewriteError, match=r"cannot parse syntax_error.py: line 6"):
        rewrite_source((FIXTURES / "syntax_error.py").read_text(), PLAN, "syntax_error.py")


def script(body: str) -> str:
    return textwrap.dedent(body).lstrip()


def test_markers_name_what_the_search_misses():
    source = script("""
        import torch
        net = build()  # memadvisor: model
        opt = make_optimizer(net)  # memadvisor: optimizer
        for step in range(3):
            sample = fetch()  # memadvisor: batch
            out = run(net, sample)  # memadvisor: forward
            loss = out.mean()
            loss.backward()
            opt.step()
        """)
    rewrite = rewrite_source(source, PLAN, "m.py")
    assert "net, opt = mem.prepare(net, opt, " in rewrite.code
    assert "    for sample in mem.micro_batches(sample):\n        out = run(net, sample)" in rewrite.code


def test_an_optimizer_made_by_a_helper_is_accepted_for_prepare_to_check():
    """issue 13: an optimizer from a call apply cannot see into (``make_optimizer(net)``,
    nanoGPT's ``model.configure_optimizers``) is accepted; ``prepare`` checks at run time
    that it is a torch optimizer over the model's parameters."""
    source = script("""
        import torch
        net = build()
        opt = make_optimizer(net)
        for step in range(3):
            loss = net(torch.randn(4, 2)).sum()
            loss.backward()
            opt.step()
        """)
    rewrite = rewrite_source(source, Plan(), "m.py")
    assert 'net, opt = mem.prepare(net, opt, plan="none")' in rewrite.code


@pytest.mark.parametrize("snippet, message", [
    ("""
        for x in data:
            loss = model(x).sum()
            if not torch.isfinite(loss):
                continue
            loss.backward()
            opt.step()
     """, "`break`/`continue` between the forward and the backward"),
    ("""
        for x in data:
            loss = model(x).sum()
            loss.backward()
            aux = model(x).mean()
            aux.backward()
            opt.step()
     """, "2 `.backward()` calls"),
    ("""
        for x in data:
            loss = model(x).sum()
            stash.append(loss)
        for loss in stash:
            loss.backward()
        opt.step()
     """, "no call to `model(...)` before the backward"),
    ("""
        fixed = 3
        for _ in range(3):
            loss = model().sum()
            loss.backward()
            opt.step()
     """, "could not tell which variables hold the batch"),
])
def test_refused_shapes(snippet, message):
    source = ("import torch\nmodel = Net()\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
              + textwrap.dedent(snippet))
    with pytest.raises(RewriteError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[")):
        rewrite_source(source, PLAN, "s.py")


def test_fixed_batch_made_before_the_loop():
    source = script("""
        import torch
        x = torch.randn(8, 4)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        """)
    rewrite = rewrite_source(source, PLAN, "s.py")
    # x is made once: the parts get their own name, so the next step splits x again
    assert "    for x_part in mem.micro_batches(x):\n        loss = model(x_part).pow(2).mean()" \
        in rewrite.code


def test_weight_decay_groups_and_future_imports():
    source = script('''
        """Doc."""
        from __future__ import annotations
        import torch
        model = torch.nn.Linear(4, 1)
        decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
        rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
        opt = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}])
        for x, y in loader:
            loss = (model(x) - y).pow(2).mean()
            loss.backward()
            opt.step()
        ''')
    rewrite = rewrite_source(source, PLAN, "s.py")
    lines = rewrite.code.splitlines()
    assert lines[1:4] == ["from __future__ import annotations", "import torch",
                          "import memadvisor.apply as mem"]
    assert "model, opt = mem.prepare(model, opt," in rewrite.code
    libcst.parse_module(rewrite.code)


def test_alias_avoids_the_scripts_names():
    source = script("""
        import torch
        mem = 4
        model = torch.nn.Linear(mem, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x in data:
            model(x).sum().backward()
            opt.step()
        """)
    rewrite = rewrite_source(source, PLAN, "s.py")
    assert "import memadvisor.apply as memadvisor_apply" in rewrite.code
    assert "memadvisor_apply.backward(model(x).sum())" in rewrite.code


def test_the_batch_is_every_tensor_the_step_reads():
    source = script("""
        import torch
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step, (x, y, w) in enumerate(data):
            x = x.to(device).view(-1, width)
            loss = ((model(x) - y).pow(2) * w).mean() * scale[step]
            if step == 3:
                print(f"{step} {x.shape}")
            loss.backward()
            optimizer.step()
        """)
    rewrite = rewrite_source(source, PLAN, "s.py")
    # not the device, the shape, the step index, or what is only printed or compared
    assert rewrite.found["batch"] == "x, y, w"


def test_an_optimizer_chosen_by_a_flag():
    source = script("""
        import torch
        model = torch.nn.Linear(2, 1)
        if args.opt == "sgd":
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        else:
            optimizer = torch.optim.AdamW(model.parameters())
        for x, y in data:
            loss = (model(x) - y).pow(2).mean()
            loss.backward()
            optimizer.step()
        """)
    code = rewrite_source(source, PLAN, "s.py").code
    assert "    optimizer = torch.optim.AdamW(model.parameters())\nmodel, optimizer = mem.prepare(" in code


CROWDED = textwrap.dedent("""
    import torch
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(3):
        x = torch.randn(8, 4)
        loss = model(x).square().mean()
        opt.zero_grad(); loss.backward(); opt.step()
""")


def test_a_step_sharing_its_line_is_refused_for_accumulation_only():
    # the micro-batch loop repeats a line whole: zero_grad and step would run per
    # micro-batch, accumulation silently gone (exit 0 before)
    with pytest.raises(RewriteError, match=r"accum=2: line 8 holds several statements"):
        rewrite_source(CROWDED, Plan.parse("accum=2"))
    # one micro-batch per step: the line runs once per step, as written
    out = rewrite_source(CROWDED, Plan.parse("optimizer=sgd")).code
    assert "opt.zero_grad(); mem.backward(loss); mem.step(opt)" in out


_MOVED_AFTER = '''
import torch
from torch import nn

def main():
    model = nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    {between}
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    {move}
    for step in range(3):
        x = torch.randn(8, 4, device=device)
        loss = model(x).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
'''


def _line_after_prepare(code: str) -> str:
    lines = [l.strip() for l in code.splitlines()]
    return lines[next(i for i, l in enumerate(lines) if "mem.prepare(" in l) - 1]


@pytest.mark.parametrize("move", ["model.to(device)", "model = model.to(device)",
                                  "model.cuda()"])
def test_prepare_follows_a_move_of_the_model_after_its_optimizer(move):
    """A model moved to its device after its optimizer is built (legal: ``.to`` changes
    the parameters in place) must be wrapped where it will run: prepare right after the
    optimizer shards it on the CPU and the move leaves FSDP's mesh there."""
    source = _MOVED_AFTER.format(between="pass", move=move)
    rewrite = rewrite_source(source, Plan.parse("shard=zero3,world=2"), "moved.py")
    assert _line_after_prepare(rewrite.code) == move


@pytest.mark.parametrize("between", [
    "scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)",
    "model = torch.compile(model)"])
def test_prepare_stays_after_the_optimizer_when_a_statement_between_uses_either(between):
    """A scheduler built on the optimizer must see the one prepare returns; a model changed
    otherwise (compiled) before the move is not what the optimizer was found with."""
    source = _MOVED_AFTER.format(between=between, move="model.to(device)")
    rewrite = rewrite_source(source, Plan.parse("shard=zero3,world=2"), "moved.py")
    assert _line_after_prepare(rewrite.code).startswith("optimizer = torch.optim.AdamW")
