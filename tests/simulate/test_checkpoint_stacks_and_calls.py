"""``checkpoint=auto`` on models nobody here wrote (issue #12): the prediction from the
baseline trace against the peak of the same loop run with ``apply``'s own checkpointing
(``apply.checkpointing.apply_checkpointing``, the ground truth).

* several stacks of repeated blocks (a ResNet's stages, a two-tower model): every stack is
  checkpointed, not only the one holding the most parameters -- a ResNet's first stage
  has the fewest parameters and the largest activations;
* a module called many times per forward (a decoder in a Python loop over time): each
  call is recomputed on its own in its backward, not all of them at once (the LSTM
  seq2seq's ``checkpoint=decoder`` was predicted +88%);
* a script that checkpoints its own blocks: plans leave them as they are, with a warning.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from memadvisor.apply.checkpointing import apply_checkpointing
from memadvisor.plan import Plan, auto_checkpoint_modules
from memadvisor.simulate import prepare, simulate
from memadvisor.simulate.hardware import hardware
from memadvisor.simulate.search import candidate_plans

BATCH = 16


class ConvBlock(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        return x + self.conv2(torch.relu(self.conv1(torch.relu(x))))


class TwoStages(nn.Module):
    """Stage 1: few channels, large images (small parameters, large activations); stage
    2: four times the channels on a quarter of the positions (the larger parameters)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.stage1 = nn.Sequential(ConvBlock(8), ConvBlock(8), ConvBlock(8))
        self.down = nn.Conv2d(8, 32, 3, stride=2, padding=1)
        self.stage2 = nn.Sequential(ConvBlock(32), ConvBlock(32), ConvBlock(32))
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        x = self.stage2(self.down(self.stage1(self.stem(x))))
        return self.head(x.mean((2, 3)))


STAGES = ["stage1.0", "stage1.1", "stage1.2", "stage2.0", "stage2.1", "stage2.2"]


def _profile(model, make_batch, loss_fn, steps=2):
    import loops
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)

    def step():
        x, y = make_batch(gen)
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()

    return loops.profile_steps(step, steps)


def _images(gen):
    return torch.randn(BATCH, 3, 32, 32, generator=gen), torch.randint(10, (BATCH,),
                                                                      generator=gen)


def _predicted_and_measured(make_model, plan, make_batch, loss_fn):
    import loops
    torch.manual_seed(0)
    base = prepare(_profile(make_model(), make_batch, loss_fn))
    prediction = simulate(base, Plan.parse(plan))
    torch.manual_seed(0)
    model = make_model()
    chosen = apply_checkpointing(model, Plan.parse(plan))
    measured = loops.measured_peak(_profile(model, make_batch, loss_fn))
    return base, prediction, chosen, measured


def test_auto_takes_every_stack_of_repeated_blocks():
    entries = [(p, type(m).__name__, sum(q.numel() for q in m.parameters()))
               for p, m in TwoStages().named_modules()]
    assert auto_checkpoint_modules(entries) == STAGES
    # a two-tower model: both towers' layers; an MLP stack alone stays one segment
    towers = [("", "Clip", 40), ("visual", "Tower", 20), ("visual.layers", "ModuleList", 20),
              ("visual.layers.0", "Layer", 10), ("visual.layers.0.fc", "Linear", 10),
              ("visual.layers.1", "Layer", 10), ("visual.layers.1.fc", "Linear", 10),
              ("text", "Tower", 20), ("text.layers", "ModuleList", 20),
              ("text.layers.0", "Layer", 10), ("text.layers.0.fc", "Linear", 10),
              ("text.layers.1", "Layer", 10), ("text.layers.1.fc", "Linear", 10)]
    assert auto_checkpoint_modules(towers) == ["visual.layers.0", "visual.layers.1",
                                               "text.layers.0", "text.layers.1"]
    mlp = [("", "Sequential", 30), ("0", "Linear", 10), ("1", "ReLU", 0), ("2", "Linear", 10),
           ("3", "ReLU", 0), ("4", "Linear", 10)]
    assert auto_checkpoint_modules(mlp) == [""]


def test_auto_on_two_stages_predicts_what_apply_measures():
    base, prediction, chosen, measured = _predicted_and_measured(
        TwoStages, "checkpoint=auto", _images, F.cross_entropy)
    assert prediction.regions == chosen == STAGES
    # the first stage's activations are most of the saving: the stack with the most
    # parameters alone (the former choice) saves less than half as much
    assert measured < 0.85 * base.peak.bytes, (measured, base.peak.bytes)
    second_only = simulate(base, Plan.parse("checkpoint=stage2.0+stage2.1+stage2.2")
                           ).peak_bytes
    assert base.peak.bytes - second_only < 0.5 * (base.peak.bytes - measured), (
        second_only, measured, base.peak.bytes)
    # each block's input is the checkpoint's argument, kept to the block's backward,
    # though nothing in the block saves it (its ReLU is out of place): predicted 41% low
    # before the transform held it
    assert abs(prediction.peak_bytes - measured) / measured < 0.02, (
        prediction.peak_bytes, measured)


class Bottleneck(nn.Module):
    """torchvision's block: 1x1, 3x3, 1x1 expanding x4, the residual added in place and an
    in-place ReLU last, which saves the block's output (the next block's input)."""

    def __init__(self, channels, width, downsample):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(channels, width, 1), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, 4 * width, 1), nn.BatchNorm2d(4 * width)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = nn.Sequential(nn.Conv2d(channels, 4 * width, 1),
                                        nn.BatchNorm2d(4 * width)) if downsample else None

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += identity
        return self.relu(out)


class BottleneckNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.layer1 = nn.Sequential(Bottleneck(16, 8, True), Bottleneck(32, 8, False))
        self.layer2 = nn.Sequential(Bottleneck(32, 16, True), Bottleneck(64, 16, False))
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        return self.head(self.layer2(self.layer1(self.stem(x))).mean((2, 3)))


def test_a_blocks_output_lives_only_as_long_as_something_outside_saves_it():
    # each block's output is saved by its own last ReLU: under checkpointing the next
    # block's checkpoint holds it (as its argument) to that block's backward, and the last
    # block's output, read by a mean that saves nothing, dies after the mean; both were
    # kept to their own block's backward (+13.6% here, resnet_channels_last +5.9%)
    base, prediction, chosen, measured = _predicted_and_measured(
        BottleneckNet, "checkpoint=auto", _images, F.cross_entropy)
    assert chosen == ["layer1.0", "layer1.1", "layer2.0", "layer2.1"]
    assert measured < 0.6 * base.peak.bytes, (measured, base.peak.bytes)
    assert abs(prediction.peak_bytes - measured) / measured < 0.01, (
        prediction.peak_bytes, measured)


VOCAB, HIDDEN, STEPS = 64, 128, 12


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, HIDDEN)
        self.mix = nn.Linear(2 * HIDDEN, 4 * HIDDEN)
        self.proj = nn.Linear(4 * HIDDEN, HIDDEN)
        self.out = nn.Linear(HIDDEN, VOCAB)

    def forward(self, token, h):
        x = torch.cat((self.embedding(token), h), dim=1)
        h = torch.tanh(self.proj(torch.relu(self.mix(x))))
        return self.out(h), h


class Seq2Seq(nn.Module):
    """A decoder called once per target position in a Python loop."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(VOCAB, HIDDEN)
        self.decoder = Decoder()

    def forward(self, src):
        h = torch.tanh(self.encoder(src))
        outputs, token = [], torch.zeros(src.shape[0], dtype=torch.long)
        for _ in range(STEPS):
            logits, h = self.decoder(token, h)
            outputs.append(logits)
            token = logits.argmax(1)  # code outside the decoder reads each call's output
        return torch.stack(outputs, dim=1)


def _sequences(gen):
    return (torch.randn(BATCH * 4, VOCAB, generator=gen),
            torch.randint(VOCAB, (BATCH * 4, STEPS), generator=gen))


def _sequence_loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def test_a_module_called_many_times_per_forward_is_recomputed_call_by_call():
    base, prediction, chosen, measured = _predicted_and_measured(
        Seq2Seq, "checkpoint=decoder", _sequences, _sequence_loss)
    assert chosen == prediction.regions == ["decoder"]
    assert measured < 0.8 * base.peak.bytes, (measured, base.peak.bytes)
    # all twelve calls recomputed at once (the former rule) predicted no saving
    assert abs(prediction.peak_bytes - measured) / measured < 0.02, (
        prediction.peak_bytes, measured)


class Looped(nn.Module):
    """A region whose own forward loops over one shared layer: one checkpoint call, one
    recompute of every iteration at once."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(VOCAB, HIDDEN)
        self.body = _SharedLoop()
        self.out = nn.Linear(HIDDEN, VOCAB)

    def forward(self, x):
        return self.out(self.body(self.inp(x)))


class _SharedLoop(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.down = nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x):
        for _ in range(6):
            x = x + self.down(torch.relu(self.up(torch.tanh(x))))
        return x


def test_a_loop_inside_a_region_stays_one_call():
    def batch(gen):
        return (torch.randn(BATCH * 8, VOCAB, generator=gen),
                torch.randint(VOCAB, (BATCH * 8,), generator=gen))

    base, prediction, chosen, measured = _predicted_and_measured(
        Looped, "checkpoint=body", batch, F.cross_entropy)
    assert chosen == ["body"]
    # split into six calls, the prediction would fall far below the measured peak
    assert prediction.peak_bytes >= 0.98 * measured, (prediction.peak_bytes, measured)


def test_blocks_the_script_checkpoints_itself_are_left_alone(loops):
    base = prepare(loops.run(checkpointed=True))
    own = base.script_checkpointed
    assert list(own.shown) == ["blocks.0", "blocks.1", "blocks.2"]
    assert any("the script checkpoints blocks.0, blocks.1, blocks.2 (Block) itself" in w
               for w in base.warnings), base.warnings
    prediction = simulate(base, Plan.parse("checkpoint=auto"))
    assert prediction.regions == []
    assert prediction.peak_bytes == base.peak.bytes
    assert prediction.cost.step_time_factor == 1.0
    # a module outside them is still checkpointed
    assert simulate(base, Plan.parse("checkpoint=head")).regions == ["head"]
    # advise proposes no checkpoint=auto plan: each would repeat the one without it
    plans = candidate_plans(base, 1, {"precision", "accum"}, hardware(None, base.meta.device))
    assert plans and all(p.checkpoint == "none" for p in plans)
    unchecked = prepare(loops.run())
    assert any(p.checkpoint == "auto" for p in candidate_plans(
        unchecked, 1, {"precision", "accum"}, hardware(None, unchecked.meta.device)))


def test_a_model_that_checkpoints_nothing_gets_no_such_warning(base):
    assert not base.script_checkpointed.shown
    assert not any("checkpoints" in w for w in base.warnings)
