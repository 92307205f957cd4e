"""What profile calls the batch, a step, a phase and a module path on training loops that
are not the one batch-first, one-optimizer shape: sequence-first data, keyword inputs,
evaluation forwards between steps, transforms, GANs, closures, methods of a model."""
from __future__ import annotations

import torch
import torch.nn as nn

from memadvisor.profile import ProfileSession, StopProfiling


def _profile(train, steps=None):
    session = ProfileSession(steps=steps, probes=False)
    try:
        with session:
            train()
    except StopProfiling:
        pass
    table, meta = session.build()
    return table.to_pandas(), meta


class SeqFirstLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Embedding(20, 8)
        self.rnn = nn.LSTM(8, 8)  # (T, B, C)
        self.decoder = nn.Linear(8, 20)

    def forward(self, tokens):
        output, _ = self.rnn(self.encoder(tokens))
        return self.decoder(output).view(-1, 20)


def test_sequence_first_batch_is_the_second_dimension():
    model = SeqFirstLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def train():
        for _ in range(2):
            data = torch.randint(0, 20, (16, 4))  # 16 steps of 4 sequences
            loss = nn.functional.cross_entropy(model(data), data.view(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

    _, meta = _profile(train)
    assert meta.batch["batch_size"] == 4
    assert meta.batch["batch_dims"] == [1]


class KeywordModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.head = nn.Linear(6, 2)

    def forward(self, input_ids=None, attention_mask=None, labels=None):
        hidden = self.embed(input_ids) * attention_mask.unsqueeze(-1)
        logits = self.head(hidden.mean(1))
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def test_keyword_inputs_are_the_batch():
    model = KeywordModel()
    optimizer = torch.optim.AdamW(model.parameters())

    def train():
        for _ in range(2):
            batch = {"input_ids": torch.randint(0, 10, (5, 7)),
                     "attention_mask": torch.ones(5, 7), "labels": torch.randint(0, 2, (5,))}
            model(**batch)["loss"].backward()
            optimizer.step()
            optimizer.zero_grad()

    _, meta = _profile(train)
    assert meta.batch["batch_size"] == 5
    assert meta.batch["names"] == ["input_ids", "attention_mask", "labels"]
    assert meta.batch["batch_dims"] == [0, 0, 0]


def test_lbfgs_closure_steps_and_an_evaluation_forward_between_them():
    """The closure's forward/backward run inside optimizer.step: the update is still the
    optimizer's; the no-grad forward on 3 test rows is not the batch of 6."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.LBFGS(model.parameters(), max_iter=3)
    data, target, test = torch.randn(6, 4), torch.randn(6, 1), torch.randn(3, 4)

    def train():
        for _ in range(3):
            def closure():
                optimizer.zero_grad()
                loss = nn.functional.mse_loss(model(data), target)
                loss.backward()
                return loss
            optimizer.step(closure)
            with torch.no_grad():
                model(test)

    events, meta = _profile(train, steps=2)
    assert meta.steps_completed == 2 and meta.step_detection == "optimizer"
    assert meta.batch["batch_size"] == 6
    for step in range(2):
        phases = set(events[events["step"] == step]["phase"])
        assert {"forward", "backward", "optimizer"} <= phases, (step, phases)


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 5))

    def forward(self, noise):
        return self.main(noise)


def _gan_training(optimizer_class):
    """A GAN's loop, pytorch/examples style: per iteration the discriminator on a real and
    a fake batch (two backward calls), then the generator.  Returns (train, the
    iterations finished)."""
    netD = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 1))
    netG = Generator()
    optimizerD = optimizer_class(netD.parameters())
    optimizerG = optimizer_class(netG.parameters())
    criterion = nn.BCEWithLogitsLoss()
    iterations = []

    def train():
        for iteration in range(4):
            real = torch.randn(6, 5)
            netD.zero_grad()
            criterion(netD(real), torch.ones(6, 1)).backward()
            fake = netG(torch.randn(6, 3))
            criterion(netD(fake.detach()), torch.zeros(6, 1)).backward()
            optimizerD.step()
            netG.zero_grad()
            criterion(netD(fake), torch.ones(6, 1)).backward()
            optimizerG.step()
            iterations.append(iteration)

    return train, iterations


def test_a_gan_step_is_one_iteration_of_both_optimizers():
    train, iterations = _gan_training(torch.optim.Adam)
    events, meta = _profile(train, steps=2)
    assert meta.steps_completed == 2
    assert iterations == [0]  # stopped in iteration 1's generator step, not after one
    assert meta.batch["batch_size"] == 6 and meta.batch["shapes"] == [[6, 5]]
    modules = set(events["module"].astype(str))
    # the discriminator (first root) is the model; the generator is named as the code
    # holds it, not by its class
    assert {"0", "netG.main.0", "criterion"} <= modules, modules
    assert not any(m.startswith("Generator") for m in modules)


class ShardWrapper(torch.optim.Optimizer):
    """As ZeroRedundancyOptimizer: the step of a local optimizer over a part of the
    parameters, then the rest of the outer step (ZeRO broadcasts the updated shards)."""

    def __init__(self, params):
        params = list(params)
        super().__init__(params, {})
        self.inner = torch.optim.SGD(params[: len(params) // 2], lr=0.1)
        self.after_inner = []

    def step(self, closure=None):
        self.inner.step()
        self.after_inner.append(torch.empty(1000))  # 4,000 B made after the inner step


def test_an_optimizer_stepped_inside_another_is_part_of_its_step():
    train, iterations = _gan_training(ShardWrapper)
    events, meta = _profile(train, steps=3)
    # before: the inner (shard) optimizers' steps were counted and covered half of the
    # parameters, so no step ended and profiling stopped after the first iteration
    assert meta.steps_completed == 3
    assert iterations == [0, 1]  # stopped in iteration 2's generator step
    made_after_inner = events[events["size_bytes"] == 4000]
    # the outer step's own work after the inner step belongs to the step it ends
    assert made_after_inner["step"].tolist() == [0, 0, 1, 1, 2, 2], made_after_inner


class VAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(6, 4), nn.ReLU())
        self.decoder = nn.Sequential(nn.Linear(4, 6))

    def encode(self, x):
        return self.encoder(x)


def test_a_part_called_from_a_method_of_its_model_keeps_its_attribute_name():
    model = VAE()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def train():
        for _ in range(2):
            x = torch.randn(3, 6)
            model.decoder(model.encode(x)).pow(2).mean().backward()
            optimizer.step()

    events, meta = _profile(train)
    modules = set(events["module"].astype(str))
    assert {"encoder.0", "decoder.0"} <= modules, modules


def test_a_transform_module_is_not_the_model():
    class Normalize(nn.Module):  # torchvision-style: no parameters, called on the data
        def forward(self, x):
            return (x - 0.5) / 0.25

    transform = Normalize()
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def train():
        for _ in range(2):
            images = torch.stack([transform(torch.rand(4)) for _ in range(5)])
            model(images).sum().backward()
            optimizer.step()

    _, meta = _profile(train)
    assert meta.batch["batch_size"] == 5 and meta.batch["shapes"] == [[5, 4]]


def test_an_optimizer_that_never_steps_does_not_stall_the_steps():
    """A frozen generator's optimizer exists but never steps: the second step of the other
    optimizer shows the cycle, and the first step still ends at the first optimizer step."""
    netD, netG = nn.Linear(5, 1), nn.Linear(3, 5)
    optimizerD = torch.optim.SGD(netD.parameters(), lr=0.1, momentum=0.9)
    unused = torch.optim.SGD(netG.parameters(), lr=0.1)  # noqa: F841 (kept alive)
    done = []

    def train():
        for iteration in range(5):
            netD(netG(torch.randn(4, 3)).detach()).sum().backward()
            optimizerD.step()
            done.append(iteration)

    events, meta = _profile(train, steps=3)
    assert meta.steps_completed == 3
    assert done == [0, 1]  # stopped in the third iteration's optimizer step, as without it
    assert [info["index"] for info in meta.steps] == [0, 1, 2]
    for step in range(3):
        phases = set(events[events["step"] == step]["phase"])
        assert {"forward", "backward"} <= phases, (step, phases)
    # the momentum buffers made by the first optimizer step belong to step 0: the first
    # boundary, placed after the fact, is at that step
    state = events[(events["category"] == "optimizer_state") & (events["action"] == "alloc")]
    assert set(state["step"]) == {0}


def test_a_linear_reading_the_input_breaks_a_tie_only_by_its_feature_dimension():
    """[B, F] into a Linear: F is features, so B; [B, T, F] with F == B: the batch is still
    before the features (dimension 0 by default), never T."""
    def train_on(shape):
        model = nn.Linear(shape[-1], 1)

        def train():
            for _ in range(2):
                model(torch.randn(*shape)).sum().backward()
        return _profile(train)[1].batch

    flat = train_on((6, 4))
    assert (flat["batch_size"], flat["batch_dims"]) == (6, [0])
    assert "Linear" in flat["evidence"]
    sequence = train_on((4, 5, 4))
    assert (sequence["batch_size"], sequence["batch_dims"]) == (4, [0])


def test_manual_updates_stop_at_the_requested_steps():
    """No torch.optim optimizer: one backward is one step, and --steps 2 means two."""
    model = nn.Linear(3, 1)
    done = []

    def train():
        for iteration in range(20):
            model(torch.randn(4, 3)).sum().backward()
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(p.grad, alpha=-0.1)
                    p.grad = None
            done.append(iteration)

    _, meta = _profile(train, steps=2)
    assert meta.steps_completed == 2 and meta.step_detection == "backward"
    assert done == [0, 1]


def test_long_gradient_accumulation_waits_for_the_optimizer_step():
    """An optimizer holds the parameters and steps every 16 backward passes: the steps are
    the optimizer's (16 backward passes each), not backward passes counted as steps, which
    stopped a profile of accum=16 before any optimizer step (no optimizer state in it)."""
    model = nn.Linear(3, 1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    stepped = []

    def train():
        for iteration in range(60):
            model(torch.randn(4, 3)).sum().backward()
            if (iteration + 1) % 16 == 0:
                opt.step()
                opt.zero_grad()
                stepped.append(iteration)

    events, meta = _profile(train, steps=2)
    assert meta.steps_completed == 2 and meta.step_detection != "backward"
    assert stepped == [15]  # stopped in the second optimizer step
    state = events[(events["category"] == "optimizer_state") & (events["action"] == "alloc")]
    assert len(state) > 0


def test_manual_updates_beside_an_optimizer_still_end_steps_at_backward():
    """An optimizer built only for its zero_grad, the update written by hand: the
    parameters change in place between backward passes, so one backward is one step."""
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    done = []

    def train():
        for iteration in range(40):
            opt.zero_grad()
            model(torch.randn(4, 3)).sum().backward()
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(p.grad, alpha=-0.1)
            done.append(iteration)

    _, meta = _profile(train, steps=2)
    assert meta.steps_completed == 2 and meta.step_detection == "backward"
    assert len(done) < 40
