"""The plans ``advise`` weighs and the order it ranks them in.

``candidate_plans``: every combination of the knobs below that ``plan.Plan`` accepts, each
priced by the fast pass (the layout bounds).  ``model_parallel_candidates``: tensor- and
pipeline-parallel plans, which the bounds cannot express, each with its *twin* -- the
plan without model parallelism on GPUs / degree ranks that the fast pass prices and
whose figures say where the model-parallel plan would land (``estimated``); ``search``
replays a few of them exactly.  ``rank_key``: what "best" means.
"""
from __future__ import annotations

import functools
import itertools
from types import SimpleNamespace

from ..errors import UserError
from ..plan import Plan, PlanError, resolve_checkpoint_per_root, tensor_parallel_blocks
from .hardware import Hardware
from .pipeline_schedule import bubble_fraction
from .simulator import Baseline, Prediction

SEMANTIC = {"bf16": "bf16", "optimizer": "optimizer"}


def _divisors_upto(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def _precisions(allow: set[str], hw: Hardware) -> list[str]:
    precisions = ["fp32", "amp-bf16"]
    if hw.device_type == "cuda":
        precisions.append("amp-fp16")
    if "bf16" in allow:
        precisions.append("bf16")
    return precisions


def _checkpoint_choices(base: Baseline) -> list[str]:
    """``auto`` where the model has repeated blocks that the script does not already
    checkpoint itself (those plans would only repeat the ones without it)."""
    if not base.blocks:
        return ["none"]
    own = base.script_checkpointed
    if own is not None and own.modules:
        try:
            regions = resolve_checkpoint_per_root(Plan(checkpoint="auto"), base.meta.modules)
        except PlanError:
            return ["none"]
        if all(own.covers(region) for region in regions):
            return ["none"]
    return ["none", "auto"]


def candidate_plans(base: Baseline, gpus: int, allow: set[str], hw: Hardware) -> list[Plan]:
    precisions = _precisions(allow, hw)
    optimizers = ["keep"] + (["sgd", "sgd-momentum", "adafactor", "adam8bit"]
                             if "optimizer" in allow else [])
    checkpoints = _checkpoint_choices(base)
    batch = base.batch_size or 1
    worlds = sorted({w for w in (1, 2, 4, 8, 16, 32, 64) if w <= gpus} | {gpus})
    shards_for = {1: ["none"]}
    offloads = [frozenset()]
    if hw.device_type == "cuda":
        offloads += [frozenset({"optimizer"}), frozenset({"activations"}),
                     frozenset({"optimizer", "params"}),
                     frozenset({"optimizer", "params", "activations"})]
    out = []
    for world in worlds:
        if batch % world:
            continue
        shards = shards_for.get(world, ["ddp", "zero1", "zero2", "zero3"])
        accums = _divisors_upto(batch // world, 64)
        hybrids = [None] + [g for g in (2, 4, 8) if g < world and world % g == 0]
        for shard, precision, checkpoint, accum, offload, optimizer, hybrid in itertools.product(
                shards, precisions, checkpoints, accums, offloads, optimizers, hybrids):
            if hybrid is not None and shard not in ("zero1", "zero2", "zero3"):
                continue
            try:
                out.append(Plan(precision=precision, checkpoint=checkpoint, accum=accum,
                                shard=shard, world=world, hybrid=hybrid, offload=offload,
                                optimizer=optimizer))
            except PlanError:
                continue
    return out


#: model-parallel degrees ``advise`` tries, tp and pp alike (those dividing the GPUs)
MODEL_PARALLEL_DEGREES = (2, 4, 8)
#: model-parallel plans replayed exactly per kind and degree (the bounds cannot express them)
EXACT_PER_DEGREE = 2
#: pipeline micro-batches tried per stage: M = P (the fewest 1F1B runs: one in flight per
#: stage), 2P, 4P -- more shrink the bubble (P-1)/(M+P-1) and each micro-batch's
#: activations, for more point-to-point sends
MICROBATCHES_PER_STAGE = (1, 2, 4)


def degree(plan: Plan) -> tuple[int, int]:
    """(tp, pp): plans of one degree are chosen among themselves (``search``)."""
    return plan.tp, plan.pp


def tensor_parallel_candidates(base: Baseline, gpus: int, allow: set[str], hw: Hardware
                               ) -> list[tuple[Plan, Plan]]:
    """(tp plan, its twin) for every tp plan ``advise`` could propose: ``tp=T,world=T`` when
    the GPUs are T, else ``tp=T,shard=zero3,world=GPUs`` (FSDP over GPUs/T groups), for T
    in ``MODEL_PARALLEL_DEGREES`` dividing the GPUs, crossed with precision, checkpoint,
    accumulation and the optimizers tp runs with.  The twin: the same plan without tp on
    GPUs/T ranks -- the same micro-batch and the same ZeRO group, what tp then splits.
    Empty when the model has no block tp splits (``plan.tensor_parallel_blocks``, as apply
    and simulate)."""
    blocks = tensor_parallel_blocks(base.meta.modules)
    if gpus < 2 or not (blocks.attention or blocks.mlp):
        return []
    batch = base.batch_size or 1
    optimizers = ["keep"] + (["sgd", "sgd-momentum"] if "optimizer" in allow else [])
    out = []
    for tp, groups in _degrees(gpus, batch):
        shard = "zero3" if groups > 1 else "none"
        for precision, checkpoint, accum, optimizer in itertools.product(
                _precisions(allow, hw), _checkpoint_choices(base),
                _divisors_upto(batch // groups, 64), optimizers):
            knobs = dict(precision=precision, checkpoint=checkpoint, accum=accum, shard=shard,
                         optimizer=optimizer)
            out += _pair(dict(knobs, world=gpus, tp=tp), dict(knobs, world=groups))
    return out


def pipeline_parallel_candidates(base: Baseline, gpus: int, allow: set[str], hw: Hardware
                                 ) -> list[tuple[Plan, Plan]]:
    """(pp plan, its twin) for every pp plan ``advise`` could propose: ``pp=P,world=P`` when
    the GPUs are P, else ``pp=P,shard=ddp|zero1|zero2|zero3,world=GPUs`` (GPUs/P pipelines
    side by side), for P in ``MODEL_PARALLEL_DEGREES`` dividing the GPUs and at most the
    model's repeated blocks (``base.blocks``, the stack apply and simulate cut into
    stages), schedule 1F1B with M = P, 2P, 4P micro-batches dividing a pipeline's batch,
    crossed with precision, checkpoint and optimizer.  The twin: the same plan without pp
    on GPUs/P ranks with ``accum=M`` -- the same micro-batch; its stage 0 holds about what
    the twin does of activations (P in flight, each of 1/P of the blocks) beside 1/P of
    the model state.  Empty with one GPU or fewer than 2 blocks."""
    # gpipe is not proposed: the same bubble as 1F1B for the same M, holding all M
    # micro-batches in flight on every stage where 1F1B holds min(M, P - s) -- never faster,
    # never leaner; its one reach beyond 1F1B, M < P, has a larger bubble than 1F1B at M = P
    # for the same activations per stage (B/M samples through 1/P of the blocks).
    # interleaved (V stages per rank) is not proposed yet: its twin is 1F1B's, so the twins'
    # front cannot choose between the two
    if gpus < 2:
        return []
    batch = base.batch_size or 1
    optimizers = ["keep"] + (["sgd", "sgd-momentum", "adafactor", "adam8bit"]
                             if "optimizer" in allow else [])
    out = []
    for pp, pipelines in _degrees(gpus, batch):
        if pp > len(base.blocks):
            continue
        shards = ["ddp", "zero1", "zero2", "zero3"] if pipelines > 1 else ["none"]
        counts = [pp * k for k in MICROBATCHES_PER_STAGE if (batch // pipelines) % (pp * k) == 0]
        for shard, precision, checkpoint, microbatches, optimizer in itertools.product(
                shards, _precisions(allow, hw), _checkpoint_choices(base), counts, optimizers):
            knobs = dict(precision=precision, checkpoint=checkpoint, shard=shard,
                         optimizer=optimizer)
            out += _pair(dict(knobs, world=gpus, pp=pp, microbatches=microbatches),
                         dict(knobs, world=pipelines, accum=microbatches))
    return out


def three_dimensional_candidates(base: Baseline, gpus: int, allow: set[str], hw: Hardware
                                 ) -> list[tuple[Plan, Plan]]:
    """(pp x tp plan, its twin): ``pp=P,tp=T`` on P x T GPUs, or beside GPUs / (P T) copies
    of itself (``shard=ddp|zero3``), for P and T in ``MODEL_PARALLEL_DEGREES`` with P x T
    dividing the GPUs (at least 4), P at most the model's blocks, the model's blocks tp can
    split; 1F1B with M = P, 2P, 4P; crossed with precision and checkpoint.  The twin: the
    same plan without either on GPUs / (P T) ranks with ``accum=M`` (the same micro-batch),
    stretched by the bubble as pp's (``estimated``)."""
    blocks = tensor_parallel_blocks(base.meta.modules)
    if gpus < 4 or not (blocks.attention or blocks.mlp):
        return []
    batch = base.batch_size or 1
    out = []
    for pp, tp in itertools.product(MODEL_PARALLEL_DEGREES, MODEL_PARALLEL_DEGREES):
        if gpus % (pp * tp) or pp > len(base.blocks) or batch % (gpus // (pp * tp)):
            continue
        pipelines = gpus // (pp * tp)
        shards = ["ddp", "zero3"] if pipelines > 1 else ["none"]
        counts = [pp * k for k in MICROBATCHES_PER_STAGE if (batch // pipelines) % (pp * k) == 0]
        for shard, precision, checkpoint, microbatches in itertools.product(
                shards, _precisions(allow, hw), _checkpoint_choices(base), counts):
            knobs = dict(precision=precision, checkpoint=checkpoint, shard=shard)
            out += _pair(dict(knobs, world=gpus, pp=pp, tp=tp, microbatches=microbatches),
                         dict(knobs, world=pipelines, accum=microbatches))
    return out


def model_parallel_candidates(base: Baseline, gpus: int, allow: set[str], hw: Hardware
                              ) -> list[tuple[Plan, Plan]]:
    """Every (model-parallel plan, its twin) ``advise`` could propose: tp, pp, then both."""
    return (tensor_parallel_candidates(base, gpus, allow, hw)
            + pipeline_parallel_candidates(base, gpus, allow, hw)
            + three_dimensional_candidates(base, gpus, allow, hw))


def _degrees(gpus: int, batch: int) -> list[tuple[int, int]]:
    """(degree, GPUs / degree) for the degrees dividing the GPUs whose data-parallel
    groups divide the batch."""
    return [(d, gpus // d) for d in MODEL_PARALLEL_DEGREES
            if d <= gpus and not gpus % d and not batch % (gpus // d)]


def _pair(plan_knobs: dict, twin_knobs: dict) -> list[tuple[Plan, Plan]]:
    """[(plan, twin)], or [] where ``Plan`` refuses either."""
    try:
        return [(Plan(**plan_knobs), Plan(**twin_knobs))]
    except PlanError:
        return []


def estimated(plan: Plan, twin: Prediction):
    """Where the twin's fast-pass figures say ``plan`` lands, as ``rank_key`` reads a
    prediction: a pipeline stretches the twin's step by its bubble, 1 / (1 - (P-1)/(M+P-1))
    (M = P and M = 4P differ by ~1.6x at P = 4: ranked on the twin's step alone, every
    M would look alike); tp's all-reduces are left out (the same share of every twin's
    step, near enough to keep their order)."""
    if plan.pp <= 1:
        return twin
    stretch = _bubble_stretch(plan.schedule, plan.pp, plan.pipeline_stages_per_rank,
                              plan.pipeline_microbatches)
    return SimpleNamespace(plan=twin.plan, step_time_factor=twin.step_time_factor * stretch,
                           peak_bytes=twin.peak_bytes, reserved_bytes=twin.reserved_bytes)


@functools.lru_cache(maxsize=None)
def _bubble_stretch(schedule: str, pp: int, stages_per_rank: int, microbatches: int) -> float:
    """1 / (1 - bubble): kept, as the fast pass asks it of every twin (running torch's
    schedule each time was ~0.1 s of advise at 126 pp plans)."""
    return 1.0 / (1.0 - bubble_fraction(schedule, pp, stages_per_rank, microbatches))


#: what "best" means: ``cost`` GPU-time per step (step time x GPUs: a second GPU that
#: halves the step costs the same, and communication makes it cost more), ``speed`` wall
#: time per step (GPUs are free), ``memory`` the smallest peak
OBJECTIVES = ("cost", "speed", "memory")


def rank_key(objective: str):
    """The sort key of a prediction under ``objective``; ties go to the plan with fewer
    techniques, then the smaller peak."""
    # the step-time factor as ``output`` reports it (4 digits), rounded to 3: the order is
    # that of the figures shown (rounding the raw factor once, a tp plan's 0.25249 ranked
    # as 0.252 but showed as 0.2525 -> x0.253, after a 0.2524)
    if objective == "speed":
        return lambda p: (round(_shown(p), 3), _complexity(p.plan), p.peak_bytes)
    if objective == "memory":
        return lambda p: (p.reserved_bytes or p.peak_bytes, round(_shown(p), 3),
                          _complexity(p.plan))
    if objective == "cost":
        return lambda p: (round(_shown(p) * p.plan.world, 3), _complexity(p.plan),
                          p.peak_bytes)
    raise UserError(f"--objective takes {', '.join(OBJECTIVES)}; got {objective!r}")


def _shown(prediction: Prediction) -> float:
    return round(prediction.step_time_factor, 4)


def _complexity(plan: Plan) -> int:
    """Techniques the plan adds; model parallelism counts (a pipeline tying with DDP on
    GPU-time is the more to run)."""
    default = Plan()
    return sum(getattr(plan, key) != getattr(default, key) for key in (
        "precision", "checkpoint", "accum", "shard", "hybrid", "optimizer", "tp",
        "pp")) + len(plan.offload)
