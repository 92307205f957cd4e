"""The fast paths of the event order: the same order, and the same allocation stream, as
the plain definitions they stand for."""
import os
import sys

import numpy as np
import pytest

from memadvisor.plan import Plan, PlanError
from memadvisor.simulate import hardware, prepare
from memadvisor.simulate.accumulation import (accumulated_events, accumulated_peak,
                                              apply_accumulation)
from memadvisor.simulate.replay import merge_order, replay_events
from memadvisor.simulate.search import candidate_plans
from memadvisor.simulate.simulator import transform

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))


def _plain_merge(keys, rows, parent_order, parent_rows, changed):
    """``merge_order`` by its definition: a stable sort by key of [the parent's order
    without the changed rows, the changed and added rows' frees, then their allocs]."""
    moved = changed[:parent_rows] if changed is not None else np.zeros(parent_rows, bool)
    row_of = np.where(parent_order < parent_rows, parent_order, parent_order - parent_rows)
    kept = parent_order[~moved[row_of]]
    kept = np.where(kept < parent_rows, kept, kept + rows - parent_rows)
    added = np.concatenate([np.flatnonzero(moved), np.arange(parent_rows, rows)])
    items = np.concatenate([kept, added, added + rows])
    return items[np.argsort(keys[items], kind="stable")]


@pytest.mark.parametrize("added", [0, 3, 5000])
@pytest.mark.parametrize("changed_rows", [0, 7, 4000])
def test_merge_order_is_a_stable_sort(added, changed_rows):
    rng = np.random.default_rng(added * 31 + changed_rows)
    parent_rows = 20_000
    rows = parent_rows + added
    # integer keys: many ties, between kept, changed and added events alike
    alloc = rng.integers(0, 3000, rows).astype(float)
    free = alloc + rng.integers(0, 50, rows)
    parent_keys = np.concatenate([free[:parent_rows] - 1e-7, alloc[:parent_rows]])
    parent_order = np.argsort(parent_keys, kind="stable")
    changed = np.zeros(parent_rows, bool)
    changed[rng.choice(parent_rows, changed_rows, replace=False)] = True
    alloc[:parent_rows][changed] = rng.integers(0, 3000, changed_rows)
    free[:parent_rows][changed] = alloc[:parent_rows][changed] + 1
    keys = np.concatenate([free - 1e-7, alloc])
    expected = _plain_merge(keys, rows, parent_order, parent_rows, changed)
    assert np.array_equal(merge_order(keys, rows, parent_order, parent_rows, changed),
                          expected)


@pytest.fixture(scope="module")
def synthetic_base(tmp_path_factory):
    from advise_speed import synthetic_trace
    from memadvisor.trace.io import read_trace
    path = synthetic_trace(str(tmp_path_factory.mktemp("order") / "t.trace"), events=20_000,
                           blocks=4, batch=16)
    return prepare(read_trace(path))


def _same_stream(base, hw, plans):
    checked = 0
    for plan in plans:
        try:
            timeline, *_ = transform(base, plan, hw, cache={})
        except PlanError:
            continue
        accumulated_peak(timeline, plan.accum, False)  # orders it, as ``simulate`` does
        sizes, rows = replay_events(apply_accumulation(timeline, plan.accum))
        fast_sizes, fast_rows = accumulated_events(timeline, plan.accum)
        assert np.array_equal(sizes, fast_sizes), str(plan)
        assert np.array_equal(rows, fast_rows), str(plan)
        checked += 1
    return checked


def test_accumulated_events_are_the_laid_out_timelines_on_tinylm(base):
    hw = hardware("h100-80gb")
    plans = [p for p in candidate_plans(base, 4, {"bf16"}, hw) if p.accum > 1][::3]
    assert _same_stream(base, hw, plans) > 50


def test_accumulated_events_are_the_laid_out_timelines_on_a_transformer(synthetic_base):
    hw = hardware("h100-80gb")
    plans = [Plan.parse(spec) for spec in (
        "accum=2", "accum=4,checkpoint=auto", "accum=8,precision=amp-bf16,shard=zero3,world=2",
        "accum=2,checkpoint=auto,offload=activations,shard=zero2,world=2", "accum=1")]
    assert _same_stream(synthetic_base, hw, plans) == 5
