"""The profiler's byte accounting against facts the tests measure themselves.

Each bundled example is profiled once (``example_runs`` in tests/conftest.py) for three
steps, with a global optimizer hook measuring parameters, gradients and optimizer state
through torch, and torch.profiler(profile_memory=True) watching the same run.
"""
from __future__ import annotations

import numpy as np
import pytest

from memadvisor.trace import analysis
from memadvisor.trace.summary import summarize

EXAMPLES = ("gpt_lm", "cnn_classifier", "mlp_regressor", "vit_classifier")
PEAK_TOLERANCE = 0.01  # the bar: the traced peak within 1% of torch.profiler's


def _signed(events) -> np.ndarray:
    sizes = events["size_bytes"].to_numpy(dtype=np.int64)
    return np.where(events["action"].astype(str).to_numpy() == "alloc", sizes, -sizes)


def _own_live(events) -> np.ndarray:
    """Live bytes after each event, computed here, not by memadvisor.trace.analysis."""
    return np.cumsum(_signed(events))


def _live_of(events, category: str, upto: int | None = None) -> int:
    """Live bytes of ``category`` after the first ``upto`` events (all when None)."""
    part = events if upto is None else events.iloc[:upto]
    mask = (part["category"].astype(str) == category).to_numpy()
    return int(_signed(part)[mask].sum())


def _end_of_step(events, step: int) -> int:
    """Number of events up to and including the last event of ``step``."""
    steps = events["step"].to_numpy()
    return int(np.searchsorted(steps, step, side="right"))


@pytest.mark.parametrize("name", EXAMPLES)
def test_three_steps_were_recorded_and_measured(example_runs, name):
    run = example_runs.get(name)
    meta = run.trace.meta
    assert meta.steps_completed == 3
    assert meta.step_detection == "optimizer"
    assert len(meta.steps) == 3
    # the facts' hook saw the same three optimizer steps, the session stopped at the third
    assert len(run.facts) == 3
    print(f"{name}: {len(run.trace):,} events, profiled in {run.wall_s:.2f} s")


@pytest.mark.parametrize("name", EXAMPLES)
def test_parameter_bytes_equal_the_models_unique_parameters(example_runs, name):
    run = example_runs.get(name)
    facts = run.facts[-1]
    events = run.trace.events
    assert facts.parameter_bytes > 0
    assert run.trace.meta.parameter_bytes == facts.parameter_bytes
    assert run.trace.meta.parameter_count == facts.parameter_count
    assert _live_of(events, "parameter") == facts.parameter_bytes
    # the parameters live through the whole run: the same bytes at the end of every step
    for step in range(3):
        assert _live_of(events, "parameter", _end_of_step(events, step)) == facts.parameter_bytes


def test_tied_weights_are_counted_once(example_runs):
    run = example_runs.get("gpt_lm")
    model = run.module.GPT(vocab_size=256, seq_len=32, n_layer=2, d_model=64, n_head=4)
    assert model.lm_head.weight is model.tok_emb.weight
    once = sum(p.numel() * p.element_size() for p in model.parameters())
    twice = sum(p.numel() * p.element_size()
                for _, p in model.named_parameters(remove_duplicate=False))
    assert twice - once == model.tok_emb.weight.numel() * 4
    assert run.facts[-1].parameter_bytes == once
    assert run.trace.meta.parameter_bytes == once


@pytest.mark.parametrize("name", EXAMPLES)
def test_optimizer_state_bytes_equal_the_tensors_in_optimizer_state(example_runs, name):
    run = example_runs.get(name)
    facts = run.facts[-1]
    trace = run.trace
    last = trace.meta.steps_completed - 1
    assert facts.optimizer_state_bytes > 0
    assert _live_of(trace.events, "optimizer_state",
                    _end_of_step(trace.events, last)) == facts.optimizer_state_bytes
    assert trace.meta.optimizers[0]["class"] == run.optimizer_class
    assert trace.meta.optimizers[0]["state_bytes"] == facts.optimizer_state_bytes
    assert summarize(trace)["optimizer_state_bytes"] == facts.optimizer_state_bytes


@pytest.mark.parametrize("name", EXAMPLES)
def test_optimizer_state_has_the_size_the_algorithm_implies(example_runs, name):
    """A check of the independent facts themselves: Adam(W) keeps two moments per
    parameter plus a 4-byte float32 step counter per tensor, SGD one momentum buffer."""
    run = example_runs.get(name)
    facts = run.facts[-1]
    if run.optimizer_class in ("Adam", "AdamW"):
        expected = 2 * facts.parameter_bytes + 4 * facts.parameter_tensors
    else:
        assert run.optimizer_class == "SGD"
        expected = facts.parameter_bytes
    assert facts.optimizer_state_bytes == expected


@pytest.mark.parametrize("name", EXAMPLES)
def test_gradient_bytes_equal_the_grads_the_optimizer_saw(example_runs, name):
    run = example_runs.get(name)
    facts = run.facts[-1]
    assert facts.gradient_bytes == facts.parameter_bytes  # every parameter is trained
    assert summarize(run.trace)["gradient_bytes"] == facts.gradient_bytes
    events = run.trace.events
    # set_to_none=True: the gradients are freed and made again in every step
    for step in range(3):
        in_step = events[(events["step"] == step) & (events["action"] == "alloc")
                         & (events["category"] == "gradient")]
        assert int(in_step["size_bytes"].sum()) == facts.gradient_bytes, step
        assert set(in_step["phase"].astype(str)) == {"backward"}


@pytest.mark.parametrize("name", EXAMPLES)
def test_buffer_bytes_equal_the_models_buffers(example_runs, name):
    run = example_runs.get(name)
    facts = run.facts[-1]
    assert run.trace.meta.buffer_bytes == facts.buffer_bytes
    assert _live_of(run.trace.events, "buffer") == facts.buffer_bytes
    if name == "cnn_classifier":
        # BatchNorm's running mean/var (float32) and num_batches_tracked (int64)
        assert facts.buffer_bytes > 0


NO_NATIVE_HOOK_CNN = (
    "without the native allocator hook the trace cannot see the scratch oneDNN convolution "
    "and max-pool allocate inside their kernels (~1.5% low on the CNN)")


@pytest.mark.parametrize("name", EXAMPLES)
def test_peak_matches_torch_profiler_within_one_percent(example_runs, name, request):
    run = example_runs.get(name)
    native = run.trace.meta.allocator.get("cpu_native_hook", "absent")
    if name == "cnn_classifier" and native != "on":
        request.applymarker(pytest.mark.xfail(strict=True, reason=NO_NATIVE_HOOK_CNN))
    traced = analysis.live_bytes(run.trace.events)
    assert np.array_equal(traced, _own_live(run.trace.events))
    traced_peak = int(traced.max())
    reference = run.kineto_peak_bytes
    print(f"{name}: traced peak {traced_peak:,} B, torch.profiler peak {reference:,} B "
          f"({run.kineto_memory_events:,} memory events), "
          f"ratio {traced_peak / reference:.4f}; native hook: {native}")
    assert reference > 0
    assert abs(traced_peak - reference) <= PEAK_TOLERANCE * reference


@pytest.mark.parametrize("name", EXAMPLES)
def test_every_free_matches_an_earlier_alloc(example_runs, name):
    events = example_runs.get(name).trace.events
    assert np.array_equal(events["seq"].to_numpy(), np.arange(len(events)))
    assert (np.diff(events["time_ns"].to_numpy()) >= 0).all()
    assert (np.diff(events["step"].to_numpy()) >= 0).all()
    assert (events["size_bytes"].to_numpy() >= 0).all()
    alive: dict[int, tuple[int, str]] = {}
    freed: set[int] = set()
    for sid, action, size, category in zip(events["storage_id"], events["action"].astype(str),
                                           events["size_bytes"], events["category"].astype(str)):
        if action == "alloc":
            assert sid not in alive and sid not in freed, f"storage {sid} allocated twice"
            alive[sid] = (size, category)
        else:
            assert action == "free"
            assert alive.pop(sid) == (size, category), f"storage {sid} freed unlike its alloc"
            freed.add(sid)
    assert (_own_live(events) >= 0).all()
    assert set(events["category"].astype(str)) <= {
        "parameter", "buffer", "gradient", "optimizer_state", "activation",
        "autocast_weight", "temporary", "input", "other"}


@pytest.mark.parametrize("name", EXAMPLES)
def test_step_records_agree_with_the_events(example_runs, name):
    trace = example_runs.get(name).trace
    events = trace.events
    live = _own_live(events)
    times = events["time_ns"].to_numpy()
    previous_end = 0
    for info in trace.meta.steps:
        index = info["index"]
        window = slice(_end_of_step(events, index - 1) if index else 0,
                       _end_of_step(events, index))
        assert window.stop > window.start, f"step {index} has no events"
        assert info["peak_bytes"] == int(live[window].max())
        assert info["start_ns"] == previous_end
        assert info["end_ns"] > info["start_ns"]
        assert info["duration_s"] == pytest.approx((info["end_ns"] - info["start_ns"]) / 1e9)
        assert times[window].min() >= info["start_ns"]
        assert times[window].max() <= info["end_ns"]
        previous_end = info["end_ns"]
    summary = summarize(trace)
    assert summary["peak_bytes"] == trace.meta.steps[-1]["peak_bytes"]
    assert [s["peak_bytes"] for s in summary["steps"]][:3] == \
        [s["peak_bytes"] for s in trace.meta.steps]


def test_steady_state_steps_repeat_the_same_memory(example_runs):
    """Steps 1 and 2 of the GPT run do the same work on same-shaped data: the same bytes
    allocated, per category, and the same peak."""
    events = example_runs.get("gpt_lm").trace.events
    allocs = events[events["action"] == "alloc"]
    per_step = allocs.groupby(["step", "category"], observed=True)["size_bytes"].sum()
    assert per_step.loc[1].to_dict() == per_step.loc[2].to_dict()
    meta_steps = example_runs.get("gpt_lm").trace.meta.steps
    assert meta_steps[1]["peak_bytes"] == meta_steps[2]["peak_bytes"]
