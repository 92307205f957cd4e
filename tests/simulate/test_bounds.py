"""The layout bounds ``advise`` ranks plans with give the exact replay's peak, plan by plan."""
import os
import sys

import pytest

from memadvisor.plan import PlanError
from memadvisor.simulate import hardware, prepare, simulate
from memadvisor.simulate.search import advise, candidate_plans
from memadvisor.simulate.simulator import max_micro_batch, quick_simulate

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))


def _compare(base, hw, plans):
    cache, bounds, checked = {}, {}, 0
    for plan in plans:
        try:
            exact = simulate(base, plan, hw, run_allocator=False, cache=cache, categories=False)
        except PlanError:
            continue
        fast = quick_simulate(base, plan, hw, cache, bounds)
        assert fast is not None, plan
        # the same sums in another order: at most a byte of float rounding
        assert abs(fast.peak_bytes - exact.peak_bytes) <= 1, (str(plan), fast.peak_bytes,
                                                               exact.peak_bytes)
        assert fast.step_time_factor == pytest.approx(exact.step_time_factor)
        checked += 1
    return checked


@pytest.mark.parametrize("gpu", [None, "h100-80gb"])
def test_bounds_equal_replay_for_every_candidate_plan(base, gpu):
    hw = hardware(gpu, base.meta.device)
    plans = candidate_plans(base, 8, {"bf16", "optimizer"}, hw)
    assert _compare(base, hw, plans) > 500


@pytest.fixture(scope="module")
def synthetic_base(tmp_path_factory):
    from advise_speed import synthetic_trace
    from memadvisor.trace.io import read_trace
    path = synthetic_trace(str(tmp_path_factory.mktemp("big") / "t.trace"), events=20_000,
                           blocks=4, batch=16)
    return prepare(read_trace(path))


def test_bounds_equal_replay_on_a_transformer_shaped_trace(synthetic_base):
    # FSDP units, offload, accumulation: every rule the bounds mirror, on a CUDA target
    hw = hardware("h100-80gb")
    plans = candidate_plans(synthetic_base, 8, {"optimizer"}, hw)[::5]
    assert _compare(synthetic_base, hw, plans) > 200


def test_largest_micro_batch_is_the_same_through_the_bounds(synthetic_base):
    hw = hardware("h100-80gb")
    budget = int(synthetic_base.peak.bytes * 0.6)
    for spec in ("accum=2", "shard=zero3,world=4", "checkpoint=auto,shard=zero2,world=2,accum=2"):
        from memadvisor.plan import Plan
        plan = Plan.parse(spec)
        assert max_micro_batch(synthetic_base, plan, hw, budget, cache={}, bounds_cache={}) == \
            max_micro_batch(synthetic_base, plan, hw, budget), spec


def test_advise_shows_exact_replays(synthetic_base):
    hw = hardware("h100-80gb")
    result = advise(synthetic_base, hw, int(synthetic_base.peak.bytes * 0.7), 4)
    assert result.ranked
    for prediction in result.ranked:
        assert prediction.timeline is not None  # replayed exactly, not the bounds' figure
        exact = simulate(synthetic_base, prediction.plan, hw)
        assert prediction.peak_bytes == exact.peak_bytes
        # every plan shown gets the allocator model (reserved memory)
        assert prediction.reserved_bytes == exact.reserved_bytes is not None


def _shown(result):
    return ([(p.plan.to_compact(), p.peak_bytes, p.reserved_bytes, p.allocated_bytes,
              p.step_time_factor, p.micro_batch_size) for p in result.ranked],
            [(plan.to_compact(), why) for plan, why in result.rejected],
            result.max_micro_batch, result.evaluated)


@pytest.mark.parametrize("gpus", [2, 4])
def test_advise_ranks_as_replaying_every_plan_would(synthetic_base, monkeypatch, gpus):
    # the bounds, one layout at a time, against the exact replay of every plan (no bounds,
    # nothing dropped): the same plans shown, in the same order, with the same figures
    from memadvisor.simulate import search
    hw = hardware("h100-80gb")
    budget = int(synthetic_base.peak.bytes * 0.7)
    fast = advise(synthetic_base, hw, budget, gpus)
    with monkeypatch.context() as patch:
        patch.setattr(search, "quick_simulate", lambda *args: None)
        replayed = advise(synthetic_base, hw, budget, gpus)
    assert _shown(fast) == _shown(replayed)
    assert len(fast.ranked) == 10
    over = {p.plan.to_compact(): p.peak_bytes for p in replayed.too_big}
    assert over.keys() == {p.plan.to_compact() for p in fast.too_big}
    for prediction in fast.too_big:
        assert abs(prediction.peak_bytes - over[prediction.plan.to_compact()]) <= 1


def test_advise_holds_one_layout_at_a_time(synthetic_base, monkeypatch):
    import weakref

    from memadvisor.simulate import simulator
    from memadvisor.simulate.bounds import LayoutBounds
    alive, most = [], [0]

    class Counted(LayoutBounds):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            alive.append(weakref.ref(self))
            most[0] = max(most[0], sum(r() is not None for r in alive))

    monkeypatch.setattr(simulator, "LayoutBounds", Counted)
    result = advise(synthetic_base, hardware("h100-80gb"), int(synthetic_base.peak.bytes * 0.7), 4)
    assert len(alive) > 20 and result.ranked  # every layout was built, one after another
    assert most[0] == 1
