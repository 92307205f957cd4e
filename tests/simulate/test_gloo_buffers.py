"""gloo's collective buffers in FSDP2 plans (``sharding._fsdp_rows``, device rule
``collective_copies``): one clone per reduce-scatter, held until the rank's next collective."""
from memadvisor.plan import Plan
from memadvisor.simulate import simulate
from memadvisor.simulate.hardware import DEVICE_RULES, hardware
from memadvisor.simulate.sharding import shard_additions
from memadvisor.simulate.simulator import _model_stage, _regions


def _additions(base, copies, shard="zero2"):
    plan = Plan.parse(f"shard={shard},world=2")
    timeline = _model_stage(base, plan, hardware(None, "cpu"), _regions(base, plan, None))
    return shard_additions(timeline, shard, base.blocks, base.block_parameter_fraction,
                           copies)[0]


def test_one_clone_per_reduce_scatter(base):
    units = len(base.blocks) + 1  # the blocks and the root
    none = _additions(base, {"all_gather": 0, "reduce_scatter": 0})
    one = _additions(base, {"all_gather": 0, "reduce_scatter": 1})
    assert len(one["size"]) - len(none["size"]) == units
    # more than one copy is never added (the dispatch engine counted gloo's clone twice)
    assert len(_additions(base, {"all_gather": 0, "reduce_scatter": 2})["size"]) == \
        len(one["size"])


def test_held_buffers_live_until_the_next_collective(base):
    prompt = _additions(base, {"all_gather": 1, "reduce_scatter": 1})
    held = _additions(base, {"all_gather": 1, "reduce_scatter": 1, "held_until_next": True})
    assert len(prompt["size"]) == len(held["size"])
    assert sorted(held["alloc_key"]) == sorted(prompt["alloc_key"])
    assert (held["free_key"] - held["alloc_key"]).sum() > \
        (prompt["free_key"] - prompt["alloc_key"]).sum()
    # nothing held outlives the step's backward (the micro-step layout stays expressible)
    assert held["free_key"].max() <= prompt["free_key"].max()


def test_cpu_target_predicts_what_apply_measures_the_prompt_case(base):
    """apply drains gloo after each collective (apply/gloo_release.py): on the CPU target
    the buffers die with the collective, and there is no second figure."""
    assert DEVICE_RULES["cpu"]["collective_copies"]["held_until_next"] is False
    assert DEVICE_RULES["cuda"]["collective_copies"]["held_until_next"] is False
    plan = Plan.parse("shard=zero3,world=2")
    prediction = simulate(base, plan, hardware(None, "cpu"))
    assert "peak_bytes_if_collectives_free_at_once" not in prediction.notes


def test_a_rule_that_holds_reports_both_outcomes(base):
    """A backend whose worker thread may free late (gloo on a group apply did not make):
    ``peak_bytes`` is the late bound, the note the prompt figure."""
    plan = Plan.parse("shard=zero3,world=2")
    rules = DEVICE_RULES["cpu"]["collective_copies"]
    prompt = simulate(base, plan, hardware(None, "cpu")).peak_bytes
    saved = dict(rules)
    try:
        rules["held_until_next"] = True
        late = simulate(base, plan, hardware(None, "cpu"))
    finally:
        rules.clear()
        rules.update(saved)
    assert late.notes["peak_bytes_if_collectives_free_at_once"] == prompt
    assert prompt <= late.peak_bytes
    gpu = simulate(base, plan, hardware("h100-80gb"))
    assert "peak_bytes_if_collectives_free_at_once" not in gpu.notes
