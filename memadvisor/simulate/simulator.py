"""One plan's prediction: the techniques composed over the baseline timeline.

Order (fixed; each step sees what the previous ones made):

1. checkpoint      lifetimes of saved activations, recompute in backward
2. precision       dtypes and sizes, autocast copies, fp32 islands
3. optimizer       state and step temporaries of the new optimizer; device rules
                   (foreach temporaries on a CUDA target); under zero2/zero3 the
                   gradients' FSDP lifetimes (unsharded until their reduce-scatter)
4. batch           batch-dependent sizes scaled to the micro-batch B / (world / tp * accum)
4b. tensor parallel the split Linears' state and the activations inside split blocks
                   divided by tp, the all-reduced partial sums (``tensor_parallel``)
5. sharding        per-rank shards, gathered units, DDP buckets
6. offload         state / shards / saved activations moved to the host
7. accumulation    the forward+backward segment repeated per micro-batch

Everything up to 6 acts on positions of the recorded step; accumulation last lays the
segment out ``accum`` times, copying what 1-6 added inside it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from ..errors import UserError
from ..plan import FSDP_SHARDS, Plan, PlanError, repeated_blocks, resolve_checkpoint_per_root
from ..trace import schema
from ..trace.analysis import analysed_step
from ..trace.io import Trace
from . import allocator as allocator_model
from .accumulation import accumulated_events, accumulated_peak
from .batch import RESIZE_OP, mark_batch_scaling, parameter_shapes, scale_batch
from .batch_coupling import coupling, coupling_warning
from . import inplace_dtypes, ragged_batch
from .checkpoint import apply_checkpoint
from .own_checkpoints import ScriptCheckpointed, script_checkpointed
from .cost import (Cost, WorkProfile, estimate, flops_from_shapes, with_shape_flops,
                   work_profile)
from .hardware import (LINK_EFFICIENCY, Hardware, cublas_workspace_bytes, device_rules,
                       hardware)
from .bounds import LayoutBounds
from .loop import hoisted_zero_grad, rewrites_loop
from .offload import apply_offload, offload_activations, saved_activation_bytes
from .optimizer_swap import FOREACH_OP, apply_optimizer_swap
from .precision import apply_precision, scaler_bytes
from .replay import CATEGORY_CODE, PHASE_CODE, Timeline, build_timeline
from .sharding import apply_sharding, fsdp_layout, shard_additions
from .tensor_parallel import apply_tensor_parallel, communication_seconds
from . import pipeline_parallel


@dataclass
class Baseline:
    """Everything about a trace that plans share, computed once."""

    timeline: Timeline
    meta: schema.TraceMeta
    batch_size: int
    device_type: str
    module_parameter_bytes: dict[str, int]
    blocks: list[str]
    block_parameter_fraction: dict[str, float]
    work: WorkProfile
    peak: object
    warnings: list[str] = field(default_factory=list)
    #: the timeline as ``apply``'s loop rewrite runs it (``loop.hoisted_zero_grad``)
    rewritten: Timeline | None = None
    #: the op that couples the batch's samples (``batch_coupling``), or None
    batch_coupled: str | None = None
    #: modules the script checkpoints itself (``own_checkpoints.script_checkpointed``): plans
    #: leave them as they are, as apply does
    script_checkpointed: ScriptCheckpointed | None = None
    #: the script's calls of ops refusing mixed dtypes (``inplace_dtypes.Sites``), or None
    dtype_sites: object = None
    #: (precision, device type) -> why that precision cannot run the script, or None
    dtype_refusals: dict = field(default_factory=dict)
    #: the batch is samples of different sizes concatenated (``ragged_batch``), or None
    ragged_batch: str | None = None


def prepare(trace: Trace) -> Baseline:
    meta = trace.meta
    if meta.steps_completed < 1 or not meta.steps:
        why = f" ({meta.error})" if meta.error else ""
        raise UserError(f"{trace.path or 'trace'}: the profiled run completed no training "
                        f"step (status {meta.status}{why}); profile a run that completes "
                        "at least one step")
    warnings = []
    if meta.status != "completed":
        warnings.append(f"the profiled run ended with status {meta.status}; predictions use "
                        f"its last complete step ({meta.steps_completed - 1})")
    timeline = build_timeline(trace)
    module_types = {m.get("path", ""): m.get("type", "") for m in meta.modules or ()}
    timeline = mark_batch_scaling(timeline, meta.batch or {}, parameter_shapes(timeline),
                                  meta.probes or {}, module_types)
    if (timeline.op_in((RESIZE_OP,)) & (timeline.size > 0)).any():
        warnings.append("the trace resizes storages in place (FSDP's gathered parameters): "
                        "plans are predicted from the step as recorded, those storages "
                        "included; for shard plans profile the script without FSDP")
    if not (meta.batch or {}).get("batch_size"):
        warnings.append("the trace records no batch size: accumulation and world sizes "
                        "cannot scale activations")
    sources = inplace_dtypes.row_sources(trace, timeline)
    coupled = coupling(timeline, int((meta.batch or {}).get("batch_size") or 0),
                       lambda row: inplace_dtypes.where(*sources, row))
    if coupled:
        warnings.append(coupling_warning(coupled))
    ragged = ragged_batch.ragged(trace.events, meta)
    if ragged:
        warnings.append(ragged)
    own_checkpoints = script_checkpointed(trace.events, analysed_step(trace), module_types)
    if own_checkpoints.shown:
        warnings.append(own_checkpoints.warning(module_types))
    module_bytes = {m["path"]: int(m.get("parameter_bytes", 0)) for m in meta.modules}
    total = {m["path"]: int(m.get("total_parameter_bytes", 0)) for m in meta.modules}
    blocks = repeated_blocks(meta.modules) if meta.modules else []
    all_params = max(float(meta.parameter_bytes or total.get("", 0) or 1), 1.0)
    fractions = {b: total.get(b, 0) / all_params for b in blocks}
    work = work_profile(meta, meta.steps_completed)
    if not work.total_flops:
        work = with_shape_flops(work, flops_from_shapes(timeline, meta))
    # as the trace shows it (``loop.hoisted_zero_grad``); verify.baseline_as_applied asks
    # apply itself where the script is there to ask
    rewritten, _ = hoisted_zero_grad(timeline)
    return Baseline(timeline, meta, int((meta.batch or {}).get("batch_size") or 0),
                    "cuda" if str(meta.device).startswith("cuda") else "cpu",
                    module_bytes, blocks, fractions, work, timeline.peak(), warnings,
                    rewritten, coupled, own_checkpoints,
                    dtype_sites=inplace_dtypes.find_sites_in(trace, timeline),
                    ragged_batch=ragged)


@dataclass
class Prediction:
    plan: Plan
    peak_bytes: int
    by_category: dict[str, int]
    allocated_bytes: int | None
    reserved_bytes: int | None
    cost: Cost
    micro_batch_size: int
    host_bytes: dict[str, float]
    notes: dict
    regions: list[str]
    timeline: Timeline | None = field(repr=False)
    out_of_memory: bool = False

    @property
    def step_time_factor(self) -> float:
        return self.cost.step_time_factor


def _model_stage(base: Baseline, plan: Plan, hw: Hardware, regions: list[str],
                 cache: dict | None = None) -> Timeline:
    """Steps 1-3, which depend neither on the batch split nor on the ranks.  ``cache`` also
    keeps steps 1-2 (shared by every optimizer)."""
    key = _precision_key(regions, plan, hw)
    timeline = cache.get(key) if cache is not None else None
    if timeline is None:
        timeline = base.rewritten if rewrites_loop(plan) else base.timeline
        if regions:
            timeline, _ = apply_checkpoint(timeline, regions, hw.device_type)
        timeline = apply_precision(timeline, plan.precision, hw.device_type,
                                   base.module_parameter_bytes, regions, base.meta.probes,
                                   base.meta.batch,
                                   {m["path"]: m.get("type", "") for m in base.meta.modules})
        if plan.precision == "amp-fp16":
            timeline = _add_persistent(timeline, scaler_bytes(plan.precision), schema.OTHER)
        if cache is not None:
            timeline.order()
            cache[key] = timeline
    timeline = apply_optimizer_swap(timeline, plan.optimizer)
    timeline = _device_optimizer_rules(timeline, base, hw, plan)
    timeline = _cublas_workspaces(timeline, hw)
    if plan.shard in FSDP_SHARDS:
        timeline = fsdp_layout(timeline, base.blocks)
    return timeline


def transform(base: Baseline, plan: Plan, hw: Hardware, micro_batch: int | None = None,
              cache: dict | None = None, collective_copies: dict | None = None
              ) -> tuple[Timeline, list[str], dict, dict, int]:
    """The plan's per-rank timeline for one micro-step (steps 1-6 of the module doc).

    ``cache`` (a dict the caller keeps, e.g. ``advise`` over thousands of plans) holds the
    result of steps 1-3 per (checkpoint, precision, optimizer, device) with its event
    order sorted, so later steps only merge their few rows into it."""
    refuse_dtypes(base, plan, hw)
    regions = _regions(base, plan, cache)
    key = _layout_key(regions, plan, hw)[:-1]
    if cache is not None and key in cache:
        timeline = cache[key]
    else:
        timeline = _model_stage(base, plan, hw, regions, cache)
        if cache is not None:
            timeline.order()
            cache[key] = timeline
    if base.batch_size:
        micro = micro_batch or plan.micro_batch_size(base.batch_size)
        timeline = scale_batch(timeline, micro / base.batch_size)
    else:
        micro = 0
    copies = collective_copies or device_rules(hw.device_type)["collective_copies"]
    timeline, tp_notes = apply_tensor_parallel(timeline, plan, base.meta.modules, copies)
    timeline, notes = apply_sharding(timeline, plan, base.blocks, base.block_parameter_fraction,
                                     copies)
    notes.update(tp_notes)
    timeline, host = apply_offload(timeline, plan)
    # accumulation (7) is evaluated on this one-micro-step timeline: accumulated_peak
    return timeline, regions, notes, host, micro


def refuse_dtypes(base: Baseline, plan: Plan, hw: Hardware) -> None:
    """PlanError where the plan's precision meets an op of the script that refuses mixed
    dtypes (``inplace_dtypes``; decided once per precision and device), or the plan splits
    a batch of samples of different sizes concatenated (``ragged_batch``)."""
    key = (plan.precision, hw.device_type)
    if key not in base.dtype_refusals:
        base.dtype_refusals[key] = inplace_dtypes.refusal(
            base.dtype_sites, base.timeline, plan.precision, hw.device_type)
    if base.dtype_refusals[key]:
        raise PlanError(base.dtype_refusals[key])
    if base.ragged_batch and plan.data_parallel_size * plan.accum * plan.pipeline_microbatches > 1:
        raise PlanError(base.ragged_batch)


def _regions(base: Baseline, plan: Plan, cache: dict | None) -> list[str]:
    if plan.checkpoint == "none":
        return []
    key = ("regions", plan.checkpoint)
    if cache is not None and key in cache:
        return cache[key]
    regions = resolve_checkpoint_per_root(plan, base.meta.modules)
    own = base.script_checkpointed
    if own is not None and own.modules:  # left as the script runs them (apply does too)
        regions = [r for r in regions if not own.covers(r)]
    if cache is not None:
        cache[key] = regions
    return regions


def _precision_key(regions: list[str], plan: Plan, hw: Hardware) -> tuple:
    """``cache`` key of steps 0-2 (``_model_stage``)."""
    return ("precision", tuple(regions), plan.precision, hw.device_type, rewrites_loop(plan))


def layout_key(base: Baseline, plan: Plan, hw: Hardware, cache: dict) -> tuple:
    """The plan's lifetime layout: plans with one key share one ``LayoutBounds``."""
    return _layout_key(_regions(base, plan, cache), plan, hw)


def layout_cache_keys(base: Baseline, plan: Plan, hw: Hardware, cache: dict) -> tuple:
    """The ``cache`` entries ``quick_simulate`` fills for the plan's layout (its timelines of
    steps 0-2 and 0-3, what ``save_on_cpu`` moves, the rows data-parallel modes add):
    ``advise`` drops them once the last layout that needs them is done."""
    regions = _regions(base, plan, cache)
    stage = _layout_key(regions, plan, hw)[:-1]
    return (_precision_key(regions, plan, hw), stage, ("saved activations", stage),
            ("shard additions", stage))


def _layout_key(regions: list[str], plan: Plan, hw: Hardware) -> tuple:
    """What fixes a plan's lifetimes: ``transform``'s cache key plus activation offload."""
    return (tuple(regions), plan.precision, plan.optimizer, "optimizer" in plan.offload,
            hw.device_type, hw.name, rewrites_loop(plan), plan.shard in FSDP_SHARDS,
            "activations" in plan.offload)


def quick_simulate(base: Baseline, plan: Plan, hw: Hardware, cache: dict,
                   bounds_cache: dict) -> Prediction | None:
    """``simulate(..., run_allocator=False, categories=False)`` for ``advise``: the peak from
    the plan's layout bounds (``bounds.LayoutBounds``, one per lifetime layout, kept in
    ``bounds_cache``) instead of a replay; None where the bounds cannot express the plan.
    The returned prediction carries no timeline, categories or host bytes."""
    refuse_dtypes(base, plan, hw)
    if plan.tp > 1 or plan.pp > 1:
        return None  # the bounds know nothing of tensor or pipeline parallelism: replay it
    regions = _regions(base, plan, cache)
    micro = plan.micro_batch_size(base.batch_size) if base.batch_size else 0
    key = _layout_key(regions, plan, hw)
    bounds = bounds_cache.get(key)
    if bounds is None and key not in bounds_cache:
        stage_key = key[:-1]
        timeline = cache.get(stage_key)
        if timeline is None:
            timeline = _model_stage(base, plan, hw, regions, cache)
            timeline.order()
            cache[stage_key] = timeline
        sharded = timeline
        if "activations" in plan.offload:
            timeline, _ = offload_activations(timeline)
        kinds = FSDP_SHARDS if plan.shard in FSDP_SHARDS else ("ddp",)
        copies = device_rules(hw.device_type)["collective_copies"]
        # the rows data-parallel modes add depend on the stage, not on activation offload
        additions = cache.get(("shard additions", stage_key))
        if additions is None:
            additions = {kind: shard_additions(sharded, kind, base.blocks,
                                               base.block_parameter_fraction, copies)[0]
                         for kind in kinds}
            cache[("shard additions", stage_key)] = additions
        bounds = LayoutBounds(timeline, base.blocks, base.block_parameter_fraction, copies,
                              sharded, kinds, additions)
        bounds_cache[key] = bounds
    if bounds is None:
        return None
    factor = micro / base.batch_size if base.batch_size else 1.0
    peak = bounds.peak_bytes(plan, factor)
    if peak is None:
        return None
    offloaded = 0.0
    if "activations" in plan.offload:
        # what save_on_cpu moves, from the model stage that the bounds were built from
        saved_key = ("saved activations", key[:-1])
        if saved_key not in cache:
            stage = cache.get(key[:-1])
            if stage is None:
                stage = _model_stage(base, plan, hw, regions, cache)
            cache[saved_key] = saved_activation_bytes(stage)
        fixed, scaled = cache[saved_key]
        offloaded = fixed + scaled * factor
    cost = _cost(base, plan, hw, regions, offloaded)
    return Prediction(plan, peak, {}, None, None, cost, micro, {}, {}, regions, None)


def simulate(base: Baseline, plan: Plan, hw: Hardware | None = None, *,
             micro_batch: int | None = None, run_allocator: bool = True,
             expandable_segments: bool = False, cache: dict | None = None,
             categories: bool = True, allocator_stop_above: int = 0) -> Prediction:
    """``allocator_stop_above``: let the allocator model stop once reserved memory passes
    it (``advise`` only needs to know such a plan does not fit)."""
    hw = hw or hardware(None, base.meta.device)
    timeline, regions, notes, host, micro = transform(base, plan, hw, micro_batch, cache)
    peak = accumulated_peak(timeline, plan.accum, categories)
    if plan.pp > 1:  # per stage; the worst stage is the plan's peak (pipeline_parallel.py)
        stages = notes["pipeline_parallel"] = pipeline_parallel.stage_peaks(
            timeline, plan, base.blocks, base.block_parameter_fraction)
        worst = stages["stages"][stages["worst_stage"]]
        peak = type(peak)(stages["peak_bytes"], -1.0, worst["by_category"])
    copies = device_rules(hw.device_type)["collective_copies"]
    if cache is None and (plan.shard in FSDP_SHARDS or plan.tp > 1) and copies.get(
            "held_until_next"):
        # a backend whose worker thread frees what a collective used at once or, scheduled
        # late, around the next collective (gloo without apply's drain): a race.
        # ``peak_bytes`` is the late outcome; say what a prompt run measures too
        prompt, *_ = transform(base, plan, hw, micro_batch, None,
                               {**copies, "held_until_next": False})
        notes["peak_bytes_if_collectives_free_at_once"] = accumulated_peak(
            prompt, plan.accum, False).bytes
    allocated = reserved = None
    oom = False
    if run_allocator and hw.device_type == "cuda" and plan.pp > 1:
        allocated = reserved = peak.bytes  # per stage: the allocator model is not run there
    elif run_allocator and hw.device_type == "cuda":
        sizes, rows = accumulated_events(timeline, plan.accum)
        result = allocator_model.replay(sizes, rows, hw.memory_bytes, expandable_segments,
                                        allocator_stop_above)
        allocated, reserved, oom = (result.peak_allocated_bytes, result.peak_reserved_bytes,
                                    result.out_of_memory)
    elif hw.device_type == "cpu":
        allocated = reserved = peak.bytes  # the CPU allocator does not cache
    cost = _cost(base, plan, hw, regions, host.get("activations_peak", 0.0),
                 _model_share(plan, notes))
    if plan.tp > 1:
        cost = _with_tensor_parallel_time(cost, notes, plan, hw)
    if plan.pp > 1:
        cost = pipeline_parallel.with_pipeline_time(
            cost, notes["pipeline_parallel"], plan, hw.interconnect_bytes_s * LINK_EFFICIENCY)
    return Prediction(plan, peak.bytes, peak.by_category, allocated, reserved, cost, micro,
                      host, notes, regions, timeline, oom)


def _model_share(plan: Plan, notes: dict) -> float:
    """The share of the model's parameters (and gradients) a rank's data-parallel
    collectives carry: tensor parallelism's split of them, the busiest stage's blocks and
    the layers every stage keeps under a pipeline."""
    share = 1.0
    if plan.tp > 1:
        share *= notes.get("tensor_parallel", {}).get("gradient_share", 1.0)
    if plan.pp > 1:
        stages = notes.get("pipeline_parallel", {}).get("stages", [])
        share *= max((s["parameter_share"] for s in stages), default=1.0)
    return share


def _cost(base: Baseline, plan: Plan, hw: Hardware, regions: list[str],
          offloaded_activation_bytes: float, model_share: float = 1.0) -> Cost:
    """The plan's step-time cost; ``offloaded_activation_bytes``: what ``save_on_cpu``
    moves per micro-step (the host's activation bytes); ``model_share``: of the model's
    parameters, what a rank holds and communicates (``_model_share``)."""
    parameter_bytes = _model_parameter_bytes(base, plan) * model_share
    meta = base.meta
    count = float(meta.trainable_parameter_count or meta.parameter_count
                  or (meta.parameter_bytes or 0) / 4)
    # gradients have the parameters' size and dtype
    return estimate(plan, base.work, hw, regions, parameter_bytes, parameter_bytes,
                    offloaded_activation_bytes, count)


def _with_tensor_parallel_time(cost: Cost, notes: dict, plan: Plan, hw: Hardware) -> Cost:
    """The tensor-parallel all-reduces (``tensor_parallel.communication_seconds``) added
    to the step, as a named term."""
    link = hw.interconnect_bytes_s * LINK_EFFICIENCY
    seconds = communication_seconds(notes, plan.accum, link)
    volume = notes.get("tensor_parallel", {}).get("communication_bytes_per_micro_step", 0.0)
    terms = cost.terms + [(f"tp={plan.tp} all-reduces {volume * plan.accum:,.0f} B/step per "
                           f"rank at {link / 1e9:.3g} GB/s, on the critical path", seconds)]
    return Cost(cost.baseline_step_s, cost.step_time_s + seconds, terms, cost.assumptions)


def _model_parameter_bytes(base: Baseline, plan: Plan) -> float:
    total = float(base.meta.parameter_bytes or 0)
    if plan.precision == "bf16":
        total /= 2
    return total


def _add_persistent(timeline: Timeline, nbytes: int, category: str) -> Timeline:
    if nbytes <= 0:
        return timeline
    return timeline.appended({"size": np.array([float(nbytes)]), "alloc_key": np.array([-1.0]),
                              "free_key": np.array([float(timeline.n_events)]),
                              "category": np.array([CATEGORY_CODE[category]], np.int8)})


#: ops that run on cuBLAS on a CUDA target (and so make its thread's workspace)
CUBLAS_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",
                        "aten::addbmm", "aten::matmul", "aten::linear", "aten::addmv",
                        "aten::mv", "aten::_scaled_mm"})


def _cublas_workspaces(timeline: Timeline, hw: Hardware) -> Timeline:
    """cuBLAS's workspace on a CUDA target: one caching-allocator block per thread that
    runs a matmul -- the forward's (main) thread and autograd's backward thread -- made
    on its first matmul and kept for the life of the process (hardware.
    cublas_workspace_bytes; CUBLAS_WORKSPACE_CONFIG overrides the size).  A trace recorded
    on a GPU holds them already (``cublas_workspace`` rows): nothing is added then."""
    if hw.device_type != "cuda" or "cublas_workspace" in timeline.ops:
        return timeline
    matmuls = timeline.op_in(CUBLAS_OPS)
    threads = sum(bool((matmuls & (timeline.phase == PHASE_CODE[phase])).any())
                  for phase in (schema.FORWARD, schema.BACKWARD))
    nbytes = cublas_workspace_bytes(hw, os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    for _ in range(threads):
        timeline = _add_persistent(timeline, nbytes, schema.OTHER)
    return timeline


def _device_optimizer_rules(timeline: Timeline, base: Baseline, hw: Hardware,
                            plan: Plan) -> Timeline:
    """A CUDA target runs Adam with ``foreach``: ``_foreach_sqrt`` of the second moments
    makes one temporary per parameter, all alive at once (a list of tensors, one
    allocation each: the caching allocator packs them like any parameter-sized blocks),
    where the recorded CPU step made them one at a time.  Only Adam kept as it is: the
    swapped-in optimizers (bitsandbytes' 8-bit Adam, Adafactor, SGD) are modelled by their
    own step (``optimizer_swap``).  Sharding divides the list with the state
    (``sharding.shard_sizes``): each rank steps its own shard."""
    target, recorded = device_rules(hw.device_type), device_rules(base.device_type)
    if target["optimizer_foreach"] == recorded["optimizer_foreach"]:
        return timeline
    if plan.optimizer != "keep" or not any(
            "adam" in str(o.get("class", "")).lower() for o in base.meta.optimizers):
        return timeline
    if not target["optimizer_foreach"] or "optimizer" in plan.offload or plan.tp > 1:
        # tp: apply steps tensor by tensor (apply/tensor_parallel.without_foreach)
        return timeline
    optimizer = PHASE_CODE[schema.OPTIMIZER]
    temps = (timeline.phase == optimizer) & timeline.category_mask(schema.TEMPORARY)
    params = np.flatnonzero(timeline.category_mask(schema.PARAMETER) & (timeline.alloc_key < 0))
    events = np.flatnonzero(timeline.event_phase == optimizer)
    start = float(events[0]) if len(events) else float(timeline.n_events) - 1
    out = timeline.dropped(~temps).with_op(FOREACH_OP)
    count = len(params)
    return out.appended({"size": timeline.size[params].astype(float),
                         "dtype": timeline.dtype[params],
                         "alloc_key": np.full(count, start + 0.5),
                         "free_key": np.full(count, start + 0.75),
                         "phase": np.full(count, optimizer, np.int8),
                         "op": np.full(count, out.ops.index(FOREACH_OP), np.int32)})


def max_micro_batch(base: Baseline, plan: Plan, hw: Hardware, budget_bytes: float,
                    limit: int = 1 << 16, cache: dict | None = None,
                    bounds_cache: dict | None = None,
                    expandable_segments: bool = False) -> int:
    """Largest micro-batch (samples per rank per micro-step) whose peak fits the budget;
    0 when even one sample does not fit.  Sizes are linear in the micro-batch, so the plan
    is transformed once and only rescaled while bisecting (through the plan's layout
    bounds when ``bounds_cache`` is given).  On a CUDA target the answer must also fit in
    reserved memory: the allocator model checks it (``_largest_reserved_fit``)."""
    if not base.batch_size or base.batch_coupled:
        return 0  # a (B, B) tensor grows with the square of the batch: no linear answer
    parts = plan.data_parallel_size * plan.accum
    reference = max(base.batch_size // parts, 1)
    bounds = None
    if bounds_cache is not None:
        quick_simulate(base, plan, hw, cache if cache is not None else {}, bounds_cache)
        bounds = bounds_cache.get(_layout_key(_regions(base, plan, cache), plan, hw))
    if bounds is not None and bounds.peak_bytes(plan, reference / base.batch_size) is not None:
        def fits(m: int) -> bool:
            return bounds.peak_bytes(plan, m / base.batch_size) <= budget_bytes
    else:
        timeline, *_ = transform(base, plan, hw, micro_batch=reference, cache=cache)
        scaled = timeline.scales_with_batch

        def fits(m: int) -> bool:
            sizes = np.where(scaled, timeline.size * (m / reference), timeline.size)
            return accumulated_peak(timeline.resized(sizes), plan.accum,
                                    False).bytes <= budget_bytes

    if not fits(1):
        return 0
    low, high = 1, 2
    while high <= limit and fits(high):
        low, high = high, high * 2
    high = min(high, limit + 1)
    while high - low > 1:
        mid = (low + high) // 2
        if fits(mid):
            low = mid
        else:
            high = mid
    if hw.device_type == "cuda":
        low = _largest_reserved_fit(base, plan, hw, budget_bytes, low, cache,
                                    expandable_segments)
    return low


def _largest_reserved_fit(base: Baseline, plan: Plan, hw: Hardware, budget_bytes: float,
                          high: int, cache: dict | None, expandable_segments: bool,
                          runs: int = 6) -> int:
    """The largest micro-batch up to ``high`` (which fits in allocated bytes) that the
    allocator model also fits in reserved bytes.  Reserved memory is not monotonic in the
    micro-batch (segment rounding), so this bisects with at most ``runs`` allocator replays
    and returns the largest size it *verified*: smaller than the true answer at worst,
    never one that does not fit."""
    def fits(m: int) -> bool:
        p = simulate(base, plan, hw, micro_batch=m, cache=cache, categories=False,
                     expandable_segments=expandable_segments,
                     allocator_stop_above=int(budget_bytes))
        return not p.out_of_memory and (p.reserved_bytes or p.peak_bytes) <= budget_bytes

    if high < 1 or fits(high):
        return high
    low = 0
    for _ in range(runs):
        if high - low <= 1:
            break
        mid = (low + high) // 2
        if fits(mid):
            low = mid
        else:
            high = mid
    if low == 0 and high > 1 and fits(1):
        low = 1
    return low
