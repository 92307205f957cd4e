"""Data-parallel plans on the kinds of models a new-user trial crashed them on.

* ddp/zero1 on a script that uses ``model.<attr>`` after wrapping (a temperature clamped
  after the step, a config read, a submodule and a method called without gradients, an
  attribute set): ``ModelFacingDDP`` answers for the script's model.
* zero2/zero3 on a model with a 0-dim parameter (CLIP's ``logit_scale``): kept whole on
  every rank with its gradient averaged (fsdp_params.py).
* zero2/zero3 on a ``channels_last`` model: its conv weights made contiguous first.

Each runs on 2 gloo ranks and must end at the unmodified run's parameters within the
tolerance of the other sharding tests (apply_runs.same_math_error).
"""
import math
import textwrap

import pytest
import torch
import torch.distributed as dist
from torch import nn

from apply_runs import relative_error, run_distributed, run_original, same_math_error
from memadvisor.apply.ddp_wrapper import ModelFacingDDP
from memadvisor.plan import PlanError

ATTRIBUTES = '''
import torch, torch.nn as nn

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)
        self.temperature = nn.Parameter(torch.tensor(1.0))
        self.config = {"hidden": 16}
        self.scale = 1.0

    def forward(self, x):
        return self.head(torch.relu(self.encoder(x))) / self.temperature * self.scale

    def embed(self, x):
        return self.encoder(x)

def main():
    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for i in range(4):
        x = torch.randn(8, 16)
        # a parameter read outside the forward (CLIP's logit_scale in the loss): DDP's
        # forward prepared the backward, so its gradient is all-reduced with the rest
        loss = (model(x) * model.temperature.pow(2)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            model.temperature.clamp_(0.5, 2.0)
            model.encoder(x)
            model.embed(x)
        assert model.config["hidden"] == 16
        model.scale = 1.0 + 0.1 * i  # changes the forward: must reach the model

if __name__ == "__main__":
    main()
'''

SCALAR = '''
import math
import torch, torch.nn as nn

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)
        self.logit_scale = nn.Parameter(torch.ones([]) * math.log(1 / 0.07))

    def forward(self, x):
        return self.lin(x) * self.logit_scale.exp()

def main():
    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for i in range(4):
        x = torch.randn(8, 32)
        loss = model(x).pow(2).mean() / 100
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            model.logit_scale.clamp_(0, math.log(100))

if __name__ == "__main__":
    main()
'''

CHANNELS_LAST = '''
import torch, torch.nn as nn

def main():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
    model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for i in range(4):
        x = torch.randn(8, 3, 12, 12).contiguous(memory_format=torch.channels_last)
        y = torch.randint(0, 10, (8,))
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

if __name__ == "__main__":
    main()
'''


def check_plans(tmp_path, source, plans):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(source))
    original = run_original(script, [])
    results = run_distributed([(script, plan, []) for plan in plans], 2, tmp_path, timeout_s=120)
    for plan, params in zip(plans, results):
        assert same_math_error(params, original, 2) <= 1, (plan, relative_error(params, original))
    return original, results


def test_ddp_and_zero1_keep_the_models_attributes(tmp_path):
    check_plans(tmp_path, ATTRIBUTES, ["shard=ddp,world=2", "shard=zero1,world=2"])


def test_zero2_and_zero3_train_a_scalar_parameter(tmp_path):
    original, results = check_plans(tmp_path, SCALAR, ["shard=zero2,world=2",
                                                       "shard=zero3,world=2,accum=2"])
    for params in results:  # the 0-dim parameter moved, and as in the unmodified run
        assert params[0].dim() == 0 and abs(float(params[0]) - math.log(1 / 0.07)) > 1e-3
        assert torch.allclose(params[0], original[0], rtol=1e-6)


def test_zero2_and_zero3_train_a_channels_last_model(tmp_path):
    check_plans(tmp_path, CHANNELS_LAST, ["shard=zero2,world=2", "shard=zero3,world=2"])


class TwoParts(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)
        self.note = "kept"

    def forward(self, x):
        return self.head(self.encoder(x))

    def embed(self, x):
        return self.encoder(x)


@pytest.fixture
def one_rank_group(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_the_wrapper_answers_for_the_model_and_refuses_unsynced_gradients(one_rank_group):
    torch.manual_seed(0)
    plain = nn.parallel.DistributedDataParallel(TwoParts())
    model = ModelFacingDDP(TwoParts(), shard="ddp")
    # DDP's own attributes and its state_dict keys ("module." prefix) are unchanged
    assert list(model.state_dict()) == list(plain.state_dict())
    assert isinstance(model.module, TwoParts) and model.note == "kept"
    assert model.encoder is model.module.encoder
    model.note = "changed"  # an attribute of the model is set on the model
    assert model.module.note == "changed" and "note" not in model.__dict__
    model.extra = 3  # a new name stays on the wrapper
    assert model.extra == 3 and not hasattr(model.module, "extra")
    with pytest.raises(AttributeError, match="'TwoParts' object has no attribute 'missing'"):
        model.missing
    x = torch.randn(3, 4)
    model(x).sum().backward()  # the model's forward calls its submodules: fine
    with torch.no_grad():  # without gradients a submodule or method runs outside the wrapper
        model.encoder(x)
        model.embed(x)
    model.eval()
    model.embed(x)  # evaluation mode
    model.train()
    with pytest.raises(PlanError, match=r"model.encoder\(...\) ran with gradients"):
        model.encoder(x)
    with pytest.raises(PlanError, match=r"model.embed\(...\) ran with gradients"):
        model.embed(x)
