"""Rules that follow the target device, not the recording machine: a CPU-recorded Adam step
becomes CUDA's foreach step (one temporary per parameter, all alive at once), sharded with
the optimizer state, and absent for optimizers that make no foreach temporaries."""
import numpy as np

from memadvisor.plan import Plan
from memadvisor.simulate.hardware import hardware
from memadvisor.simulate.optimizer_swap import FOREACH_OP
from memadvisor.simulate.simulator import transform
from memadvisor.trace import schema


def _foreach_sizes(base, spec, gpu="h100-80gb"):
    timeline = transform(base, Plan.parse(spec), hardware(gpu, base.device_type))[0]
    rows = timeline.op_in({FOREACH_OP}) & (timeline.size > 0)
    return timeline.size[rows]


def _parameter_sizes(base):
    t = base.timeline
    return t.size[t.category_mask(schema.PARAMETER) & (t.alloc_key < 0)]


def test_one_temporary_per_parameter_on_cuda(base):
    assert any("adam" in str(o.get("class", "")).lower() for o in base.meta.optimizers)
    sizes = _foreach_sizes(base, "none")
    params = _parameter_sizes(base)
    assert len(sizes) == len(params) > 1
    assert sorted(sizes) == sorted(params)
    # the recording machine's own rule (per-tensor loop on CPU) adds nothing
    assert len(_foreach_sizes(base, "none", gpu=None)) == 0


def test_foreach_temporaries_are_sharded_with_the_state(base):
    whole = _foreach_sizes(base, "none").sum()
    zero3 = _foreach_sizes(base, "shard=zero3,world=4").sum()
    assert whole / 4 <= zero3 <= whole / 4 + len(_parameter_sizes(base))  # ceil per tensor
    zero1 = _foreach_sizes(base, "shard=zero1,world=4").sum()
    assert zero1 < whole * 0.75
    assert np.isclose(_foreach_sizes(base, "shard=ddp,world=4").sum(), whole)


def test_no_foreach_temporaries_for_swapped_optimizers(base):
    for spec in ("optimizer=adam8bit", "optimizer=sgd", "offload=optimizer"):
        assert len(_foreach_sizes(base, spec)) == 0, spec


def test_largest_micro_batch_fits_in_reserved_memory(base, monkeypatch):
    from memadvisor.simulate import simulate, simulator
    from memadvisor.simulate.simulator import max_micro_batch
    hw = hardware("h100-80gb")
    plan = Plan.parse("precision=bf16")
    one = simulate(base, plan, hw, micro_batch=1)
    differs = 0
    for times in (2, 3, 5, 8):
        budget = one.reserved_bytes * times
        m = max_micro_batch(base, plan, hw, budget)
        assert m >= 1
        assert simulate(base, plan, hw, micro_batch=m).reserved_bytes <= budget
        # what fitting the allocated bytes alone would have answered
        with monkeypatch.context() as patch:
            patch.setattr(simulator, "_largest_reserved_fit", lambda *a: a[4])
            allocated_only = max_micro_batch(base, plan, hw, budget)
        assert allocated_only >= m
        differs += allocated_only != m
    assert differs  # reserved memory decided at least one answer
