"""The compiled replay loop (``cuda_hooks/allocator_model.cpp``) against the Python
reference (``allocator.replay(..., native=False)``): identical results on random streams
(both pools, splits, merges, queries, a device limit that forces segment release and OOM,
an early stop) and on real plans' streams."""
import numpy as np
import pytest

from memadvisor.plan import Plan
from memadvisor.simulate import native_allocator
from memadvisor.simulate.accumulation import apply_accumulation
from memadvisor.simulate.allocator import replay
from memadvisor.simulate.hardware import hardware
from memadvisor.simulate.replay import replay_events
from memadvisor.simulate.simulator import transform

pytestmark = pytest.mark.skipif(native_allocator.load() is None,
                                reason=f"compiled allocator model unavailable: "
                                       f"{native_allocator.unavailable_reason()}")


def _random_stream(rng, events):
    """Signed sizes and row ids: allocations of mixed sizes, each freed later (some never),
    some freed by the very next event (kernel temporaries: the replay's queries)."""
    sizes, rows, live = [], [], []
    row = 0
    while len(sizes) < events:
        if live and rng.random() < 0.45:
            r, size = live.pop(int(rng.integers(len(live))))
            sizes.append(-size)
            rows.append(r)
            continue
        size = float(rng.choice([rng.integers(1, 600), rng.integers(512, 1 << 20),
                                 rng.integers(1 << 20, 12 << 20), rng.integers(12 << 20, 40 << 20)],
                                p=[0.3, 0.4, 0.2, 0.1]))
        sizes.append(size)
        rows.append(row)
        if rng.random() < 0.2:  # freed at once
            sizes.append(-size)
            rows.append(row)
        else:
            live.append((row, size))
        row += 1
    return np.asarray(sizes), np.asarray(rows, np.int64)


@pytest.mark.parametrize("seed", range(6))
def test_random_streams_match_the_reference(seed):
    rng = np.random.default_rng(seed)
    sizes, rows = _random_stream(rng, 4000)
    cases = [dict(), dict(capacity_bytes=int(rng.integers(200, 600)) << 20),
             dict(stop_above_bytes=int(rng.integers(50, 300)) << 20)]
    for kwargs in cases:
        python = replay(sizes, rows, native=False, **kwargs)
        compiled = replay(sizes, rows, native=True, **kwargs)
        assert compiled == python, kwargs
    # the limits above were hit: the checks are not vacuous
    assert replay(sizes, rows, native=False, capacity_bytes=64 << 20).out_of_memory


@pytest.mark.parametrize("spec", ["none", "precision=amp-bf16,checkpoint=auto,accum=2",
                                  "shard=zero3,world=4", "offload=activations"])
def test_real_plans_match_the_reference(base, spec):
    plan = Plan.parse(spec)
    timeline, *_ = transform(base, plan, hardware("h100-80gb"))
    sizes, rows = replay_events(apply_accumulation(timeline, plan.accum))
    assert replay(sizes, rows, native=True) == replay(sizes, rows, native=False)


@pytest.mark.parametrize("seed", range(3))
def test_sparse_row_ids_and_zero_sizes_match_the_reference(seed):
    """Row ids far apart or negative (the compiled loop keeps its live storages in a hash
    map then, not a flat table) and events of size 0 (a free, as the reference reads
    them)."""
    rng = np.random.default_rng(100 + seed)
    sizes, rows = _random_stream(rng, 3000)
    sparse = rows * 1_000_003 - 7
    sizes[rng.random(len(sizes)) < 0.02] = 0.0
    for kwargs in (dict(), dict(capacity_bytes=256 << 20), dict(stop_above_bytes=100 << 20)):
        for ids in (rows, sparse):
            assert replay(sizes, ids, native=True, **kwargs) == replay(
                sizes, ids, native=False, **kwargs), kwargs


def test_fractional_sizes_round_as_the_reference():
    """Sizes that scaling made fractional round half to even, as numpy's round."""
    sizes = np.array([511.5, -511.5, 512.5, 1024.5, -512.5, 2.5, -1024.5, -2.5,
                      (1 << 20) + 0.5, -((1 << 20) + 0.5)])
    rows = np.array([0, 0, 1, 2, 1, 3, 2, 3, 4, 4])
    assert replay(sizes, rows, native=True) == replay(sizes, rows, native=False)
