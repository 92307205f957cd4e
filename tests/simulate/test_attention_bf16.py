"""16-bit attention on CPU: with dropout, ``scaled_dot_product_attention`` takes the math path,
which computes 16-bit inputs in fp32 (device rule ``sdpa_math_upcast``); a class token in
fp32 joined to 16-bit patches promotes the ``cat``.  A tiny ViT (the bundled example's
model) predicted from its fp32 trace against the same loop run in bf16 / amp-bf16 with
``apply``'s own casts."""
import importlib.util
import os

import pytest
import torch

from memadvisor.plan import Plan
from memadvisor.simulate import prepare, simulate
from memadvisor.trace.io import Trace

from loops import measured_peak, run_with_apply_precision

_EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "vit_classifier.py")


def _vit_module():
    spec = importlib.util.spec_from_file_location("vit_classifier_example", _EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(precision: str = "fp32") -> Trace:
    vit = _vit_module()
    torch.manual_seed(0)
    model = vit.ViT(image_size=16, patch=4, d_model=32, depth=1, heads=2, dropout=0.1)
    return run_with_apply_precision(model, lambda gen: vit.make_batch(4, 16, 10, gen),
                                    precision)


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
