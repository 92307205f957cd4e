"""The explanation lines: each category's change names what can move it in that direction,
or says the category is alive in another amount at the plan's peak; ``why_little`` says
what a plan adds when it raises the peak and what it leaves when it saves nothing."""
from __future__ import annotations

import json

import pytest

from memadvisor.plan import Plan
from memadvisor.simulate import explain
from memadvisor.trace import schema
from memadvisor.units import format_bytes

KIB, MIB = 1024, 1024 * 1024
#: gpt_lm's baseline peak (forward, the previous step's gradients still alive)
GPT_PEAK = {schema.PARAMETER: 3_320_832, schema.GRADIENT: 3_320_832,
            schema.OPTIMIZER_STATE: 6_641_872, schema.ACTIVATION: 8_944_000,
            schema.TEMPORARY: 512 * KIB, schema.INPUT: 4 * KIB}


def _profile(loops, model, batch: int, features: int, classes: int):
    """A trace of two Adam steps of ``model`` on random data (cross-entropy)."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)

    def step():
        x = torch.randn(batch, features, generator=generator)
        y = torch.randint(classes, (batch,), generator=generator)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    return loops.profile_steps(step, 2)


@pytest.fixture(scope="module")
def small_mlp_trace(loops):
    """Model states are 80% of the peak (batch of 8): DDP's buckets raise it."""
    import torch.nn as nn

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(*[layer for i in range(3) for layer in (
                nn.Linear(32 if i == 0 else 128, 128), nn.ReLU())])
            self.head = nn.Linear(128, 4)

        def forward(self, x):
            return self.head(self.body(x))

    return _profile(loops, MLP(), 8, 32, 4)


@pytest.fixture(scope="module")
def small_mlp(small_mlp_trace):
    from memadvisor.simulate import prepare
    return prepare(small_mlp_trace)


@pytest.fixture(scope="module")
def sequential(loops):
    """A top-level Sequential of Linear/ReLU: checkpoint=auto recomputes the whole model."""
    import torch.nn as nn

    layers = [layer for _ in range(4) for layer in (nn.Linear(64, 64), nn.ReLU())]
    from memadvisor.simulate import prepare
    return prepare(_profile(loops, nn.Sequential(*layers, nn.Linear(64, 10)), 256, 64, 10))


def _explained(base, spec: str) -> dict:
    from memadvisor.simulate import hardware, simulate
    from memadvisor.simulate.output import simulate_dict

    prediction = simulate(base, Plan.parse(spec))
    return simulate_dict(base, prediction, hardware(None, base.meta.device))


def _line(terms: list[str], label: str) -> str:
    return next(t for t in terms if t.startswith(label + " "))


# --- direction: a technique is named only for a change it can make -------------------------
def test_a_grown_category_is_not_credited_to_the_batch_split(small_mlp):
    data = _explained(small_mlp, "shard=zero3,world=4")
    before, after = data["baseline_by_category"], data["by_category"]
    assert after[schema.ACTIVATION] > before.get(schema.ACTIVATION, 0)  # the peak moved
    line = _line(data["terms"], "activations")
    assert "micro-batch" not in line
    assert line.endswith("more alive at the plan's peak (another moment of the step)")


def test_fsdp_temporaries_are_its_unsharded_gradients():
    predicted = {**GPT_PEAK, schema.TEMPORARY: 1000 * KIB}
    line = _line(explain.category_terms(GPT_PEAK, predicted, Plan.parse(
        "shard=zero3,world=4"), 2, 8), "temporaries")
    assert line == ("temporaries 512 KiB -> 1000 KiB: "
                    "unsharded gradients until their reduce-scatter")


def test_offloading_activations_is_not_credited_for_gradients():
    predicted = {**GPT_PEAK, schema.GRADIENT: 2_978_000, schema.ACTIVATION: 384 * KIB}
    terms = explain.category_terms(GPT_PEAK, predicted, Plan.parse("offload=activations"), 8, 8)
    gradients = _line(terms, "gradients")
    assert "offload" not in gradients and "fewer alive at the plan's peak" in gradients
    assert _line(terms, "activations").endswith("offload activations (save_on_cpu)")


def test_gradients_gone_at_the_peak_are_not_credited_to_bf16():
    predicted = {**GPT_PEAK, schema.GRADIENT: 0, schema.PARAMETER: GPT_PEAK[schema.PARAMETER] // 2}
    terms = explain.category_terms(GPT_PEAK, predicted, Plan.parse("precision=bf16"), 8, 8)
    assert _line(terms, "parameters").endswith(": bf16 storage")  # exactly half
    gradients = _line(terms, "gradients")
    assert "bf16" not in gradients and "none alive at the plan's peak" in gradients


def test_more_than_a_technique_can_shrink_is_the_peak_moving():
    # a micro-batch of 2 of 8 leaves at least a quarter of the activations
    predicted = {**GPT_PEAK, schema.ACTIVATION: MIB}
    line = _line(explain.category_terms(GPT_PEAK, predicted, Plan.parse("accum=4"), 2, 8),
                 "activations")
    assert line.startswith("activations 8.53 MiB -> 1 MiB: micro-batch 2 of 8; beyond that, fewer")
    within = {**GPT_PEAK, schema.ACTIVATION: GPT_PEAK[schema.ACTIVATION] // 3}
    assert _line(explain.category_terms(GPT_PEAK, within, Plan.parse("accum=4"), 2, 8),
                 "activations").endswith(": micro-batch 2 of 8")


def test_checkpoint_rng_state_and_the_fp16_scaler_are_named(base):
    data = _explained(base, "checkpoint=auto")
    assert _line(data["terms"], "other").endswith(": checkpoint's saved RNG state")
    baseline = {schema.PARAMETER: 100 * KIB}
    terms = explain.category_terms(baseline, {**baseline, schema.OTHER: 8},
                                   Plan.parse("precision=amp-fp16"), 8, 8)
    assert terms[-1] == "other 0 B -> 8 B: fp16 gradient scaler"


def test_accumulation_keeps_gradients_alive_across_micro_batches(base):
    data = _explained(base, "accum=2")
    assert data["by_category"][schema.GRADIENT] > data["baseline_by_category"].get(
        schema.GRADIENT, 0)
    assert _line(data["terms"], "gradients").endswith(
        ": kept and accumulated across micro-batches")


def test_a_gpu_foreach_step_is_named_only_at_an_optimizer_step_peak():
    baseline = {schema.PARAMETER: 149_508, schema.GRADIENT: 149_508,
                schema.OPTIMIZER_STATE: 299_048, schema.TEMPORARY: 131_852}
    step = {**baseline, schema.TEMPORARY: 149_764}
    plan = Plan.parse("precision=amp-bf16")
    assert "foreach optimizer step" in _line(
        explain.category_terms(baseline, step, plan, 64, 64), "temporaries")
    forward = {**step, schema.ACTIVATION: 2 * MIB}
    assert "foreach" not in _line(explain.category_terms(baseline, forward, plan, 64, 64),
                                  "temporaries")


@pytest.mark.parametrize("spec", ["shard=zero3,world=4", "shard=zero2,world=2",
                                  "shard=ddp,world=2", "checkpoint=auto,accum=2",
                                  "precision=bf16", "precision=amp-bf16", "optimizer=sgd"])
def test_no_line_credits_a_shrinking_technique_for_growth(base, small_mlp, spec):
    shrink_only = ("micro-batch ", "bf16 storage", "(16-bit)", "offload", " ranks",
                   "no optimizer state")
    for trace in (base, small_mlp):
        data = _explained(trace, spec)
        for category, label in explain.LABELS.items():
            before = data["baseline_by_category"].get(category, 0)
            after = data["by_category"].get(category, 0)
            if format_bytes(after) != format_bytes(before):
                line = _line(data["terms"], label)
                cause = line.split(": ", 1)[1]
                if after > before:
                    assert not any(word in cause for word in shrink_only), line
                else:
                    assert "buckets" not in cause and "gathered" not in cause.split(
                        "; plus")[0], line


# --- why_little -------------------------------------------------------------------------------
def test_why_little_names_what_a_plan_adds_when_it_raises_the_peak(small_mlp):
    data = _explained(small_mlp, "shard=ddp,world=2")
    raised = data["peak_bytes"] - data["baseline_peak_bytes"]
    assert raised > 0.1 * data["baseline_peak_bytes"]
    why = data["why_little"]
    assert why[0].startswith("the plan raises the peak by ") and format_bytes(raised) in why[0]
    # the JSON's lines use the plan's categories: the added terms are measured
    grown = data["by_category"][schema.OTHER] - data["baseline_by_category"].get(
        schema.OTHER, 0)
    assert why[1] == f"+{format_bytes(grown)} other: DDP gradient buckets"
    # without them the added terms are estimated from the plan alone
    parameters = data["baseline_by_category"][schema.PARAMETER]
    estimated = explain.small_saving_reasons(data["baseline_by_category"], data["peak_bytes"],
                                             data["baseline_peak_bytes"],
                                             Plan.parse("shard=ddp,world=2"))
    assert estimated[1] == (f"about +{format_bytes(parameters)}: DDP gradient buckets (a copy "
                            "of every gradient, alive all step)")


def test_why_little_when_checkpointing_the_whole_model_saves_nothing(sequential):
    data = _explained(sequential, "checkpoint=auto")
    assert data["checkpointed_modules"] == [""]
    assert abs(data["peak_bytes"] / data["baseline_peak_bytes"] - 1) < 0.01
    assert data["step_time_factor"] > 1.2
    # what it adds at the peak is a generator state (+0.8%); what it saves is nothing
    assert any(reason.startswith("activations are ") and "recompute brings" in reason
               for reason in data["why_little"])


def test_why_little_when_autocast_cannot_touch_model_states(small_mlp):
    data = _explained(small_mlp, "precision=amp-bf16")
    assert data["peak_bytes"] >= 0.95 * data["baseline_peak_bytes"]
    assert any("autocast keeps them fp32" in reason for reason in data["why_little"])


def test_why_little_names_the_largest_part_a_plan_leaves():
    baseline = {schema.OPTIMIZER_STATE: 8 * MIB, schema.ACTIVATION: MIB}
    (reason,) = explain.small_saving_reasons(baseline, 9 * MIB, 9 * MIB,
                                             Plan.parse("offload=activations"))
    assert reason == ("the largest part of the baseline peak, optimizer state (89%), is not "
                      "something the plan shrinks")


def test_the_cli_json_and_text_carry_the_reasons(capsys, small_mlp_trace, tmp_path):
    from memadvisor.cli import main
    from memadvisor.trace.io import write_trace

    path = str(tmp_path / "mlp.trace")
    write_trace(path, small_mlp_trace.events, small_mlp_trace.meta)
    assert main(["simulate", path, "--plan", "shard=ddp,world=2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["why_little"][0].startswith("the plan raises the peak by")
    assert _line(data["terms"], "other").endswith(": DDP gradient buckets")
    assert main(["simulate", path, "--plan", "shard=ddp,world=2"]) == 0
    assert "why it saves little:\n  the plan raises the peak by" in capsys.readouterr().out
