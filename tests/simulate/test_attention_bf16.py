"""16-bit attention on CPU: with dropout, ``scaled_dot_product_attention`` takes the math path,
which computes 16-bit inputs in fp32 (device rule ``sdpa_math_upcast``); a class token in
fp32 joined to 16-bit patches promotes the ``cat``.  A tiny ViT (the bundled example's
model) predicted from its fp32 trace against the same loop run in bf16 / amp-bf16 with
``apply``'s own casts."""
import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

from memadvisor.apply.precision import cast_parameters, wrap_forward
from memadvisor.plan import Plan
from memadvisor.profile.session import ProfileSession, StopProfiling
from memadvisor.simulate import prepare, simulate
from memadvisor.trace.io import Trace

from loops import measured_peak

_EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "vit_classifier.py")


def _vit_module():
    spec = importlib.util.spec_from_file_location("vit_classifier_example", _EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(precision: str = "fp32", steps: int = 2) -> Trace:
    vit = _vit_module()
    torch.manual_seed(0)
    model = vit.ViT(image_size=16, patch=4, d_model=32, depth=1, heads=2, dropout=0.1)
    plan = Plan.parse(f"precision={precision}")
    cast_parameters(model, plan)
    wrap_forward(model, plan, "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    session = ProfileSession(steps=steps)
    try:
        with session:
            for _ in range(steps + 1):
                images, labels = vit.make_batch(4, 16, 10, gen)
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(images).float(), labels).backward()
                opt.step()
    except StopProfiling:
        pass
    table, meta = session.build()
    return Trace(events=table.to_pandas(), meta=meta)


@pytest.fixture(scope="module")
def baseline():
    return run()


def test_the_trace_shows_the_math_path(baseline):
    assert (baseline.events["op"] == "aten::_safe_softmax").any()


@pytest.mark.parametrize("precision", ["bf16", "amp-bf16"])
def test_16bit_attention_predicted_within_1_percent(baseline, precision):
    predicted = simulate(prepare(baseline), Plan.parse(f"precision={precision}")).peak_bytes
    measured = measured_peak(run(precision))
    assert abs(predicted - measured) / measured <= 0.01, (predicted, measured)
