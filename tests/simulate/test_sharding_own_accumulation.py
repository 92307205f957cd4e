"""FSDP plans on a script that accumulates gradients itself (several forward and backward
passes per optimizer step): FSDP2's hooks gather, reshard and reduce-scatter in each pass,
so each pass is laid out on its own (``sharding.passes``).  One set of unit spans over the
whole step kept every unit gathered from the first pass's forward to the last one's (the
new-user trial's own-AMP MLP: zero2 +7.2%, zero3 +22.1% against apply --profile; now
-0.53% / +0.71%, docs/ZOO.md)."""
import numpy as np
import pytest

from memadvisor.plan import Plan
from memadvisor.simulate import prepare, simulate
from memadvisor.simulate.hardware import hardware
from memadvisor.simulate.sharding import passes, shard_additions
from memadvisor.simulate.simulator import _model_stage, _regions
from memadvisor.trace import schema

from loops import run


@pytest.fixture(scope="module")
def own_accumulation():
    return prepare(run(accum=2))


@pytest.fixture(scope="module")
def one_pass():
    return prepare(run())


def test_a_step_is_split_into_its_passes(own_accumulation, one_pass):
    assert len(passes(one_pass.timeline)) == 1
    windows = passes(own_accumulation.timeline)
    assert len(windows) == 2
    assert windows[0][0] == 0 and windows[-1][1] == own_accumulation.timeline.n_events
    assert windows[0][1] == windows[1][0]


@pytest.mark.parametrize("shard", ["zero2", "zero3"])
def test_gathered_parameters_live_within_their_pass(own_accumulation, shard):
    base = own_accumulation
    plan = Plan.parse(f"shard={shard},world=2")
    timeline = _model_stage(base, plan, hardware(None, "cpu"), _regions(base, plan, None))
    rows, _ = shard_additions(timeline, shard, base.blocks, base.block_parameter_fraction,
                              {"all_gather": 1, "reduce_scatter": 1})
    gathered = rows["category"] == schema.CATEGORIES.index(schema.PARAMETER)
    assert gathered.any()
    # a pass's pre-forward hooks sit in the half event before its first forward event
    bounds = np.array([w[0] for w in passes(timeline)][1:], float) - 0.5
    pass_of_alloc = np.searchsorted(bounds, rows["alloc_key"][gathered], side="right")
    pass_of_free = np.searchsorted(bounds, rows["free_key"][gathered], side="right")
    assert (pass_of_alloc == pass_of_free).all()
    assert set(pass_of_alloc.tolist()) == {0, 1}  # gathered again in the second pass


def test_half_batch_passes_predict_below_one_full_pass(own_accumulation, one_pass):
    """Same model and batch: two passes of half the batch hold half the activations at a
    time, with the same gathered parameters: the peak is lower."""
    plan = Plan.parse("shard=zero3,world=2")
    assert simulate(own_accumulation, plan).peak_bytes < simulate(one_pass, plan).peak_bytes
