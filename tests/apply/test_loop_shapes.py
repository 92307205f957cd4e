"""Raw training loops beyond the one shape (issue 13, deliverables 2 and 3): optimizers from
parameter-group lists and methods, GradScalers (disabled or not), closures, several models,
loops under an ``if``, model methods on a wrapped model, and the run-time checks that stop a
rewritten script whose plan did not take effect."""
import textwrap

import pytest
import torch
from torch import nn

import memadvisor.apply as mem
from apply_runs import run_applied, run_original
from memadvisor.apply import runtime
from memadvisor.apply.rewrite import RewriteError, rewrite_source
from memadvisor.plan import Plan, PlanError


@pytest.fixture(autouse=True)
def no_session():
    runtime.finish()
    yield
    runtime.finish()


def script(body: str) -> str:
    return textwrap.dedent(body).lstrip()


def write(tmp_path, name, body):
    path = tmp_path / name
    path.write_text(script(body))
    return path


NET = """
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(4, 8)
            self.head = nn.Linear(8, 1)

        def forward(self, x):
            return self.head(torch.tanh(self.body(x)))

        def configure_optimizers(self, lr):
            decay = [p for n, p in self.named_parameters() if n.endswith("weight")]
            rest = [p for n, p in self.named_parameters() if not n.endswith("weight")]
            return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                      {"params": rest, "weight_decay": 0.0}], lr=lr)
"""


# --- 1. optimizer-not-found --------------------------------------------------------------
def test_param_groups_built_by_a_helper_find_the_model_through_its_arguments():
    source = script("""
        import torch
        def groups(model, wd):
            decay, rest = [], []
            for name, p in model.named_parameters():
                (decay if p.dim() >= 2 else rest).append(p)
            return [{"params": decay, "weight_decay": wd}, {"params": rest}]
        net = torch.nn.Linear(4, 1)
        optimizer = torch.optim.AdamW(groups(net, 0.1), lr=1e-3)
        for x in data:
            loss = net(x).sum()
            loss.backward()
            optimizer.step()
        """)
    code = rewrite_source(source, Plan.parse("accum=2"), "s.py").code
    assert 'net, optimizer = mem.prepare(net, optimizer, plan="accum=2")' in code


def test_a_disabled_grad_scaler_and_a_method_made_optimizer_train_like_the_original(tmp_path):
    """nanoGPT's shape: ``model.configure_optimizers``, a GradScaler disabled on CPU, the next
    batch prefetched between forward and backward.  accum=2 splits the batch exactly, so the
    final parameters equal the unmodified run's; the prefetch still advances the data."""
    path = write(tmp_path, "nano.py", NET + """
    torch.manual_seed(0)
    data = torch.randn(64, 4)
    def get_batch(i):
        return data[8 * i: 8 * i + 8], data[8 * i: 8 * i + 8].sum(1, keepdim=True)
    model = Net()
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    optimizer = model.configure_optimizers(1e-2)
    X, Y = get_batch(0)
    for it in range(4):
        for micro_step in range(1):
            loss = (model(X) - Y).pow(2).mean()
            X, Y = get_batch(it + 1)
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    """)
    code = rewrite_source(path.read_text(), Plan.parse("accum=2"), "nano.py").code
    assert "        for X_part, Y_part in mem.micro_batches(X, Y):" in code
    # the prefetch runs once per step, after the micro-batches, under the names read next
    assert code.index("mem.backward(loss, scaler=scaler)") < code.index("X, Y = get_batch(it + 1)")
    assert "mem.step(optimizer, scaler=scaler)" in code
    assert "mem.unscale_(optimizer, scaler=scaler)" in code
    reference = run_original(path, [])
    applied = run_applied(path, "accum=2", [], tmp_path)
    assert len(applied) == len(reference) == 4
    for a, b in zip(applied, reference):
        assert torch.allclose(a, b, atol=1e-6)


def test_prepare_refuses_an_opaque_optimizer_that_is_not_one():
    model = nn.Linear(2, 1)
    with pytest.raises(PlanError, match="made by a call memadvisor cannot see into"):
        mem.prepare(model, [model.weight], plan="accum=2")
    other = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    with pytest.raises(PlanError, match="not parameters of the model given to prepare"):
        mem.prepare(model, other, plan="accum=2")


# --- 2. closures -------------------------------------------------------------------------
LBFGS = """
    import torch
    from torch import nn
    torch.manual_seed(0)
    inputs, targets = torch.randn(8, 3), torch.randn(8, 1)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
    criterion = nn.MSELoss()
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3)
    if __name__ == "__main__":
        for i in range(2):
            def closure():
                optimizer.zero_grad()
                loss = criterion(model(inputs), targets)
                loss.backward()
                return loss
            optimizer.step(closure)
"""


def test_closure_steps_refuse_accumulation_by_name_and_take_precision(tmp_path):
    path = write(tmp_path, "lbfgs.py", LBFGS)
    with pytest.raises(RewriteError, match=r"accum=2: line 15: `optimizer.step\(closure\)` "
                                           r"evaluates the loss inside the closure"):
        rewrite_source(path.read_text(), Plan.parse("accum=2"), "lbfgs.py")
    code = rewrite_source(path.read_text(), Plan.parse("precision=amp-bf16"), "lbfgs.py").code
    # free names read by the closure get their own names inside it (no UnboundLocalError)
    assert "for inputs_part, targets_part in mem.micro_batches(inputs, targets):" in code
    assert "mem.step(optimizer, closure)" in code
    reference = run_original(path, [])
    applied = run_applied(path, "precision=amp-bf16", [], tmp_path)
    assert not torch.equal(applied[0], reference[0])  # bf16 forward: close, not equal
    assert all(torch.allclose(a, b, atol=0.05) for a, b in zip(applied, reference))


# --- 3. two models, two optimizers -------------------------------------------------------
GAN = """
    import torch
    from torch import nn
    torch.manual_seed(0)
    netG = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 3))
    netD = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    optD = torch.optim.Adam(netD.parameters(), lr=1e-2)
    optG = torch.optim.Adam(netG.parameters(), lr=1e-2)
    bce = nn.BCEWithLogitsLoss()
    for real in torch.randn(3, 8, 3):
        netD.zero_grad()
        n = real.size(0)
        errD_real = bce(netD(real), torch.ones(n, 1))
        errD_real.backward()
        fake = netG(torch.randn(n, 2))
        errD_fake = bce(netD(fake.detach()), torch.zeros(n, 1))
        errD_fake.backward()
        optD.step()
        netG.zero_grad()
        errG = bce(netD(fake), torch.ones(n, 1))
        errG.backward()
        optG.step()
"""


def test_every_model_optimizer_pair_is_prepared_and_split_plans_are_refused(tmp_path):
    path = write(tmp_path, "gan.py", GAN)
    code = rewrite_source(path.read_text(), Plan.parse("precision=amp-bf16"), "gan.py").code
    assert 'netD, optD = mem.prepare(netD, optD, plan="precision=amp-bf16")' in code
    assert 'netG, optG = mem.prepare(netG, optG, plan="precision=amp-bf16")' in code
    assert "mem.step(optD)" in code and "mem.step(optG)" in code
    with pytest.raises(RewriteError, match=r"accum=2: 3 `.backward\(\)` calls \(lines 13, 16, "
                                           r"20\) per iteration, each optimizer stepped"):
        rewrite_source(path.read_text(), Plan.parse("accum=2"), "gan.py")
    # across ranks the batch is sliced at its source, once per iteration, steps included
    ddp = rewrite_source(path.read_text(), Plan.parse("shard=ddp,world=2"), "gan.py").code
    assert "for real in torch.randn(3, 8, 3):\n    for real in mem.micro_batches(real):\n" \
           "        netD.zero_grad()\n" in ddp
    assert "        mem.backward(errG)\n    mem.step(optG)\n" in ddp
    applied = run_applied(path, "precision=amp-bf16", [], tmp_path)
    reference = run_original(path, [])  # the last optimizer stepped: the generator's
    assert len(applied) == len(reference) == 4
    assert all(torch.allclose(a, b, atol=0.05) for a, b in zip(applied, reference))


# --- 4. training under an if, and the run-time checks ----------------------------------
def test_an_optimizer_made_and_stepped_only_under_a_flag_is_refused_naming_the_lines():
    source = script("""
        import torch
        model = torch.nn.Linear(2, 1)
        if args.use_optimizer:
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for x in data:
            loss = model(x).sum()
            loss.backward()
            if args.use_optimizer:
                optimizer.step()
            else:
                for p in model.parameters():
                    p.data.add_(p.grad, alpha=-0.1)
        """)
    with pytest.raises(RewriteError, match=r"line 9: `optimizer` is stepped only when "
                                           r"`args.use_optimizer` \(line 8\); the other branch "
                                           r"\(line 10\) trains without it"):
        rewrite_source(source, Plan.parse("accum=2"), "s.py")


def test_a_knob_that_did_not_take_effect_stops_before_the_first_step():
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    raw = model
    model, optimizer = mem.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                   plan="accum=2")
    mem.backward(raw(torch.ones(4, 2)).sum())  # the whole batch, outside micro_batches
    before = model.weight.detach().clone()
    with pytest.raises(PlanError, match="accum=2 did not take effect: the backward before the "
                                        "first step ran outside mem.micro_batches"):
        mem.step(optimizer)
    assert torch.equal(model.weight, before)
    runtime.finish()

    model = nn.Linear(2, 1)
    model, optimizer = mem.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                   plan="precision=amp-bf16")
    mem.backward(model.weight.sum())  # no forward: autocast never ran
    with pytest.raises(PlanError, match="precision=amp-bf16 did not take effect: Linear's "
                                        "forward never ran under autocast"):
        mem.step(optimizer)


def test_checkpointed_modules_must_be_recomputed():
    blocks = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(3)])
    model, optimizer = mem.prepare(blocks, torch.optim.SGD(blocks.parameters(), lr=0.1),
                                   plan="checkpoint=auto")
    session = runtime.current_session()
    assert session.checkpointed
    mem.backward(model(torch.randn(2, 4)).sum())
    assert session.evidence.recomputes == len(session.checkpointed)
    mem.step(optimizer)  # every knob took effect: no error
    assert session.checked


def test_an_optimizer_prepare_never_saw_is_refused():
    net = nn.Linear(2, 1)
    net, opt = mem.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1), plan="none")
    stray = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    with pytest.raises(PlanError, match="not one mem.prepare returned"):
        mem.step(stray)


# --- 5. model methods and copies on a wrapped model ------------------------------------
def test_model_methods_called_after_prepare_are_handed_to_prepare():
    source = script(NET) + script("""
        model = Net()
        optimizer = model.configure_optimizers(1e-3)
        for x in data:
            loss = model(x).sum()
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            sample = model.decode(torch.randn(2, 8))
        """)
    code = rewrite_source(source, Plan.parse("shard=zero2,world=2"), "s.py").code
    # configure_optimizers runs before prepare: only decode needs forwarding
    assert ('model, optimizer = mem.prepare(model, optimizer, plan="shard=zero2,world=2", '
            "methods=['decode'])") in code


def test_an_ema_copy_of_sharded_parameters_is_refused_under_fsdp_only():
    source = script("""
        import copy, torch
        model = torch.nn.Linear(2, 1)
        ema = copy.deepcopy(model)
        optimizer = torch.optim.Adam(model.parameters())
        for x in data:
            loss = model(x).sum()
            loss.backward()
            optimizer.step()
            for e, p in zip(ema.parameters(), model.parameters()):
                e.lerp_(p, 0.01)
        """)
    with pytest.raises(RewriteError, match=r"shard=zero3: line 9: `zip\(ema.parameters\(\), "
                                           r"model.parameters\(\)\)` updates another copy"):
        rewrite_source(source, Plan.parse("shard=zero3,world=2"), "s.py")
    rewrite_source(source, Plan.parse("shard=ddp,world=2"), "s.py")  # DDP: plain tensors


def test_whole_vector_optimizers_are_refused_under_sharding(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    model = nn.Linear(2, 1)
    lbfgs = torch.optim.LBFGS(model.parameters())
    with pytest.raises(PlanError, match="shard=zero2: LBFGS treats all parameters as one "
                                        "vector"):
        mem.prepare(model, lbfgs, plan="shard=zero2,world=2")


def test_other_stepped_objects_beside_a_real_optimizer_are_left_alone():
    source = script("""
        import torch
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        warmup = make_warmup(optimizer, 10)
        for x in data:
            loss = model(x).sum()
            loss.backward()
            optimizer.step()
            warmup.step()
        """)
    rewrite = rewrite_source(source, Plan.parse("accum=2"), "s.py")
    assert rewrite.found["optimizer"] == "optimizer" and "warmup.step()" in rewrite.code


def test_a_rewritten_script_whose_knob_misses_stops_with_its_name(tmp_path):
    """The script trains through its own method (``model.loss``), not ``model(...)``: the
    plan's autocast (around forward) never runs, so the rewritten script stops before the
    first step instead of training in fp32 and exiting 0."""
    path = write(tmp_path, "method.py", """
        import torch
        from torch import nn

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.layer = nn.Linear(3, 1)

            def loss(self, x):
                return self.layer(x).pow(2).mean()

        model = Net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for x in torch.randn(2, 4, 3):
            loss = model.loss(x)
            loss.backward()
            optimizer.step()
        """)
    with pytest.raises(PlanError, match=r"precision=amp-bf16 did not take effect: Net's "
                                        r"forward never ran under autocast"):
        run_applied(path, "precision=amp-bf16", [], tmp_path)


DECODER = """
    import torch
    from torch import nn

    class AutoEncoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.Linear(6, 2)
            self.dec = nn.Linear(2, 6)

        def decode(self, z):
            return torch.sigmoid(self.dec(z))

        def forward(self, x):
            return self.decode(torch.tanh(self.enc(x)))

    torch.manual_seed(0)
    model = AutoEncoder()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for x in torch.rand(3, 8, 6):
        loss = nn.functional.mse_loss(model(x), x)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            sample = model.decode(torch.randn(4, 2))
    print("sample", tuple(sample.shape))
"""


@pytest.mark.slow
def test_closures_and_model_methods_on_two_ranks(tmp_path):
    """LBFGS under DDP: each rank's closure loss is averaged over the ranks, so LBFGS makes
    the single process's decisions; ``model.decode`` after FSDP2 (zero2) is gathered by
    ``register_fsdp_forward_method``.  Both end where the unmodified run ends."""
    from apply_runs import run_distributed
    lbfgs = write(tmp_path, "lbfgs.py", LBFGS)
    decoder = write(tmp_path, "decoder.py", DECODER)
    gan = write(tmp_path, "gan.py", GAN)
    ranks = run_distributed([(lbfgs, "shard=ddp,world=2", []),
                             (decoder, "shard=zero2,world=2", []),
                             (gan, "shard=ddp,world=2", [])], 2, tmp_path)
    # the GAN draws its noise per rank (n = the rank's slice): trained, not equal
    gan_params, gan_reference = ranks[2], run_original(gan, [])
    assert len(gan_params) == len(gan_reference) == 4
    assert all(torch.isfinite(p).all() for p in gan_params)
    assert any(not torch.equal(a, b) for a, b in zip(gan_params, gan_reference))
    for params, path in zip(ranks, (lbfgs, decoder)):
        reference = run_original(path, [])
        assert len(params) == len(reference)
        for a, b in zip(params, reference):
            assert torch.allclose(a, b, atol=1e-5), path.name


def test_switching_a_rewritten_script_to_a_plan_its_shape_cannot_take_is_refused(tmp_path):
    lbfgs = rewrite_source(script(LBFGS), Plan.parse("precision=amp-bf16"), "l.py").code
    with pytest.raises(RewriteError, match=r"cannot switch l.py to plan accum=2: accum=2: "
                                           r"line 18: `mem.step\(optimizer, closure\)`"):
        rewrite_source(lbfgs, Plan.parse("accum=2"), "l.py")
    gan = rewrite_source(script(GAN), Plan.parse("precision=amp-bf16"), "g.py").code
    with pytest.raises(RewriteError, match=r"accum=2: 3 backward calls \(lines 17, 20, 24\) "
                                           r"per iteration"):
        rewrite_source(gan, Plan.parse("accum=2"), "g.py")
    assert rewrite_source(gan, Plan.parse("shard=ddp,world=2"), "g.py").updated_plan_only
    one_backward = rewrite_source(script(LBFGS).replace("LBFGS(", "SGD(").replace(
        "max_iter=3", "momentum=0.0"), Plan.parse("precision=bf16"), "s.py").code
    assert "mem.micro_batches" in one_backward


def test_several_backward_calls_refuse_fsdp_and_save_the_last_stepped_model(tmp_path):
    with pytest.raises(RewriteError, match=r"shard=zero2: 3 `.backward\(\)` calls \(lines 13, "
                                           r"16, 20\) per iteration: a model forwarded"):
        rewrite_source(script(GAN), Plan.parse("shard=zero2,world=2"), "gan.py")
    path = write(tmp_path, "gan.py", GAN)
    run_applied(path, "precision=bf16", [], tmp_path)
    saved = torch.load(tmp_path / "gan__precision_bf16.pt")
    assert [len(s["names"]) for s in saved["sessions"]] == [4, 4]
    assert saved["names"] == saved["sessions"][1]["names"]  # optG stepped last
    assert all(torch.equal(a, b) for a, b in zip(saved["tensors"],
                                                 saved["sessions"][1]["tensors"]))


def test_an_optimizer_swap_the_schedulers_momentum_cycling_cannot_run_is_refused():
    from memadvisor.apply.rewrite import RewriteError, rewrite_source
    from memadvisor.plan import Plan
    script = (
        "import torch\n"
        "model = torch.nn.Linear(4, 1)\n"
        "optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)\n"
        "scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=10)\n"
        "for _ in range(3):\n"
        "    x, y = torch.randn(8, 4), torch.randn(8, 1)\n"
        "    loss = torch.nn.functional.mse_loss(model(x), y)\n"
        "    loss.backward()\n"
        "    optimizer.step()\n"
        "    scheduler.step()\n"
        "    optimizer.zero_grad()\n")
    for swap in ("sgd", "adafactor"):
        try:
            rewrite_source(script, Plan.parse(f"optimizer={swap}"))
        except RewriteError as exc:
            assert f"optimizer={swap}: line 4: `OneCycleLR` cycles momentum" in str(exc)
        else:
            raise AssertionError(f"optimizer={swap} was not refused")
    # momentum to cycle, or cycling switched off: the swap is fine
    rewrite_source(script, Plan.parse("optimizer=sgd-momentum"))
    off = script.replace("total_steps=10)", "total_steps=10, cycle_momentum=False)")
    rewrite_source(off, Plan.parse("optimizer=adafactor"))
