"""``advise``: enumerate plans, drop the impossible, predict the rest, rank by step time.

Plans are every combination of the knobs below that ``plan.Plan`` accepts and the target
hardware can run.  Techniques that change training semantics (``bf16``, an optimizer
swap) are enumerated only when allowed.  Every candidate gets the fast pass (peak of
requested bytes from its lifetime layout's bounds, ``bounds.LayoutBounds``; the layouts one
at a time, ``fast_pass``, so memory holds one of them); the allocator model (reserved
memory) runs for every plan shown (the best ``top`` that fit).  A plan fits when its
reserved (or, without an allocator, peak) bytes are at most ``budget * (1 - margin)``.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from collections import Counter
from dataclasses import dataclass, field

from ..errors import UserError
from ..plan import (Environment, Plan, PlanError, environment_problems,
                    resolve_checkpoint_per_root, tensor_parallel_blocks)
from ..units import format_bytes
from .batch_coupling import split_refusal
from .hardware import Hardware
from .simulator import (Baseline, Prediction, layout_cache_keys, layout_key, max_micro_batch,
                        quick_simulate, simulate)

SEMANTIC = {"bf16": "bf16", "optimizer": "optimizer"}


@dataclass
class SearchResult:
    ranked: list[Prediction]  #: plans that fit, best first
    rejected: list[tuple[Plan, str]]  #: (plan, why) for plans that cannot run
    too_big: list[Prediction]  #: predicted over budget
    evaluated: int
    budget_bytes: int
    usable_bytes: int
    max_micro_batch: dict[str, int] = field(default_factory=dict)
    #: CPU seconds of each part of the search: the fast pass over every plan, the plans
    #: shown (exact replay, allocator model), the largest micro-batch of the best three
    cpu_seconds: dict[str, float] = field(default_factory=dict)


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


#: tensor-parallel degrees ``advise`` tries (those dividing the GPUs)
TP_DEGREES = (2, 4, 8)
#: tensor-parallel plans replayed exactly per degree (the bounds cannot express them)
TP_EXACT = 2


def tensor_parallel_candidates(base: Baseline, gpus: int, allow: set[str], hw: Hardware
                               ) -> list[tuple[Plan, Plan]]:
    """(tp plan, its twin) for every tp plan ``advise`` could propose: ``tp=T,world=T`` when
    the GPUs are T, else ``tp=T,shard=zero3,world=GPUs`` (FSDP over GPUs/T groups), for T
    in ``TP_DEGREES`` dividing the GPUs, crossed with precision, checkpoint, accumulation
    and the optimizers tp runs with.  The twin: the same plan without tp on GPUs/T ranks --
    the same micro-batch and the same ZeRO group, what tp then splits.  Empty when the
    model has no block tp splits (``plan.tensor_parallel_blocks``, as apply and simulate)."""
    blocks = tensor_parallel_blocks(base.meta.modules)
    if gpus < 2 or not (blocks.attention or blocks.mlp):
        return []
    batch = base.batch_size or 1
    optimizers = ["keep"] + (["sgd", "sgd-momentum"] if "optimizer" in allow else [])
    checkpoints = _checkpoint_choices(base)
    out = []
    for tp in TP_DEGREES:
        groups = gpus // tp
        if tp > gpus or gpus % tp or batch % groups:
            continue
        shard = "zero3" if groups > 1 else "none"
        for precision, checkpoint, accum, optimizer in itertools.product(
                _precisions(allow, hw), checkpoints, _divisors_upto(batch // groups, 64),
                optimizers):
            knobs = dict(precision=precision, checkpoint=checkpoint, accum=accum, shard=shard,
                         optimizer=optimizer)
            try:
                out.append((Plan(**knobs, world=gpus, tp=tp), Plan(**knobs, world=groups)))
            except PlanError:
                continue
    return out


class TwinStages:
    """A ``fast_pass`` watcher that keeps the model-stage timelines (steps 0-2 and 0-3) of
    the twins ``add_tensor_parallel`` will pick -- per degree, the best twin so far under
    the objective and the leanest so far -- so that their tp plans, which share the twin's
    layout, are replayed without making those timelines again (the precision and
    checkpoint rewrites are most of a replay's time).  At most two per degree are held
    beyond the layout being priced; a guess that turns out wrong only costs that time."""

    def __init__(self, plans: list[Plan], outcomes: list, pairs: list[tuple[Plan, Plan]],
                 key):
        twins: dict[str, set[int]] = {}
        for plan, twin in pairs:
            twins.setdefault(twin.to_compact(), set()).add(plan.tp)
        worlds = {twin.world for _, twin in pairs}
        self.degrees = {index: twins[plan.to_compact()] for index, plan in enumerate(plans)
                        if plan.world in worlds and plan.hybrid is None and not plan.offload
                        and plan.to_compact() in twins}
        self.pairs, self.outcomes, self.key = pairs, outcomes, key
        self.best: dict[tuple, tuple] = {}  #: (degree, role) -> (rank, entries)
        self.held: dict[tuple, object] = {}  #: cache entry -> its timeline

    def __call__(self, indices: list[int], entries: tuple, cache: dict) -> None:
        changed = False
        for index in indices:
            degrees = self.degrees.get(index)
            outcome = self.outcomes[index] if degrees else None
            if outcome is None or isinstance(outcome, tuple):
                continue
            ranks = {"best": (self.key(outcome),), "leanest": (outcome.peak_bytes,)}
            for degree in degrees:
                for role, rank in ranks.items():
                    known = self.best.get((degree, role))
                    if known is None or rank < known[0]:
                        self.best[(degree, role)] = (rank, entries[:2])
                        changed = True
        if changed:
            wanted = {entry for _, kept in self.best.values() for entry in kept}
            for entry in wanted:
                if entry not in self.held and entry in cache:
                    self.held[entry] = cache[entry]
            for entry in list(self.held):
                if entry not in wanted:
                    del self.held[entry]

    def restore(self, cache: dict, entries: tuple) -> None:
        """Put the held timelines among ``entries`` (a plan's ``layout_cache_keys``) back in
        ``cache``, as that plan is replayed (``_in_layout_order`` drops them after it)."""
        for entry in entries:
            if entry in self.held:
                cache.setdefault(entry, self.held[entry])


def twin_stages(base: Baseline, hw: Hardware, gpus: int, allow: set[str], objective: str,
                plans: list[Plan], outcomes: list) -> "TwinStages | None":
    """The ``fast_pass`` watcher for ``add_tensor_parallel``'s picks; None without tp plans."""
    pairs = tensor_parallel_candidates(base, gpus, allow, hw)
    if not pairs:
        return None
    return TwinStages(plans, outcomes, pairs, rank_key(objective))


def add_tensor_parallel(base: Baseline, hw: Hardware, gpus: int, allow: set[str],
                        objective: str, plans: list[Plan], outcomes: list, cache: dict,
                        stage_keys: set, keep=None, held: TwinStages | None = None
                        ) -> list[Plan]:
    """Append to ``plans`` and ``outcomes`` the tensor-parallel plans worth replaying, with
    their exact predictions (``simulate`` without the allocator model; the layout bounds
    know nothing of tp).  Per degree T at most ``TP_EXACT`` of them, chosen from their
    twins' fast-pass figures (``outcomes`` of the plans without tp) and no budget: the
    twins' Pareto front of ``objective`` against peak bytes -- its best plan, its leanest
    and evenly between -- so any budget finds the tp plan its twins say fits best.  A tp
    plan whose twin is not a candidate (GPUs/T not a candidate world) is not tried."""
    pairs = held.pairs if held is not None else tensor_parallel_candidates(base, gpus, allow, hw)
    if not pairs:
        return []
    worlds = {twin.world for _, twin in pairs}
    priced = {plan.to_compact(): outcome for plan, outcome in zip(plans, outcomes)
              if plan.world in worlds and plan.hybrid is None and not plan.offload
              and outcome is not None and not isinstance(outcome, tuple)}
    key = rank_key(objective)
    env = Environment(device_type=hw.device_type, bf16_supported=hw.bf16,
                      fp16_supported=hw.fp16, bitsandbytes_available=True)
    by_degree: dict[int, list] = {}
    for plan, twin in pairs:
        figures = priced.get(twin.to_compact())
        if figures is not None and not environment_problems(plan, env):
            by_degree.setdefault(plan.tp, []).append((plan, figures))
    chosen: list[Plan] = []
    for tp, entries in sorted(by_degree.items()):
        entries.sort(key=lambda entry: key(entry[1]))
        front = []
        for entry in entries:
            if not front or entry[1].peak_bytes < front[-1][1].peak_bytes:
                front.append(entry)
        last = len(front) - 1
        picks = sorted({round(i * last / max(TP_EXACT - 1, 1)) for i in range(TP_EXACT)})
        chosen += [front[i][0] for i in picks]

    def exact(plan: Plan):
        if held is not None:
            held.restore(cache, layout_cache_keys(base, plan, hw, cache))
        try:
            prediction = dataclasses.replace(
                simulate(base, plan, hw, run_allocator=False, cache=cache, categories=False),
                timeline=None)
            return keep(prediction) if keep else prediction
        except PlanError as exc:
            return (plan, str(exc))

    plans.extend(chosen)
    outcomes.extend(_in_layout_order(base, hw, chosen, cache, stage_keys, exact))
    if held is not None:
        held.held.clear()
    return chosen


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


def advise(base: Baseline, hw: Hardware, budget_bytes: int, gpus: int = 1, *,
           margin: float = 0.05, allow: set[str] | None = None, top: int = 10,
           expandable_segments: bool = False, objective: str = "cost") -> SearchResult:
    allow = allow or set()
    key = rank_key(objective)
    unknown = allow - set(SEMANTIC)
    if unknown:
        raise UserError(f"--allow takes {', '.join(SEMANTIC)}; got {', '.join(sorted(unknown))}")
    if not 0 <= margin < 1:
        raise UserError(f"the safety margin must be between 0 and 1, got {margin}")
    usable = int(budget_bytes * (1 - margin))
    rejected: list[tuple[Plan, str]] = []
    fitting: list[Prediction] = []
    too_big: list[Prediction] = []
    started = time.process_time()
    plans = candidate_plans(base, gpus, allow, hw)
    cache: dict = {}
    outcomes, by_layout = group_by_layout(base, hw, plans, cache)
    watch = twin_stages(base, hw, gpus, allow, objective, plans, outcomes)
    stage_keys = fast_pass(base, hw, plans, by_layout, cache, outcomes, watch=watch)
    cpu_seconds = {"fast pass": time.process_time() - started}
    add_tensor_parallel(base, hw, gpus, allow, objective, plans, outcomes, cache, stage_keys,
                        held=watch)
    cpu_seconds["tensor parallel"] = time.process_time() - started - cpu_seconds["fast pass"]
    for outcome in outcomes:  # in candidate order, as ties in the ranking are broken
        if isinstance(outcome, tuple):
            rejected.append(outcome)
        else:
            (fitting if outcome.peak_bytes <= usable else too_big).append(outcome)
    fitting.sort(key=key)
    # the allocator model for the best plans: reserved memory must fit too
    exact = hw.device_type == "cuda"
    ranked: list[Prediction] = []
    taken = 0
    while len(ranked) < top and taken < len(fitting):
        batch = fitting[taken:taken + top - len(ranked)]
        taken += len(batch)
        for prediction in _in_layout_order(base, hw, [p.plan for p in batch], cache, stage_keys,
                                           lambda plan: simulate(
                                               base, plan, hw, run_allocator=exact,
                                               expandable_segments=expandable_segments,
                                               cache=cache, allocator_stop_above=usable)):
            if exact and (prediction.reserved_bytes or prediction.peak_bytes) > usable:
                too_big.append(prediction)
                continue
            ranked.append(prediction)
    # the same order as the fast pass (both price every term alike), after the allocator
    # model has dropped plans whose reserved memory does not fit
    ranked.sort(key=key)
    cpu_seconds["plans shown"] = time.process_time() - started - sum(cpu_seconds.values())
    bounds = _LastLayout()  # the plans run in layout order: one layout's bounds at a time
    # a loss coupling the batch's samples grows with its square: no linear extrapolation
    # (base.warnings says so)
    # nor a batch whose size counts nodes or tokens (``ragged_batch``)
    shown = [] if base.batch_coupled or base.ragged_batch else ranked[:3]
    sizes = _in_layout_order(base, hw, [p.plan for p in shown], cache, stage_keys,
                             lambda plan: max_micro_batch(
                                 base, plan, hw, usable, cache=cache,
                                 # the bounds know nothing of tp: their layout key does not
                                 # hold it, so a tp plan would get its twin's bounds
                                 bounds_cache=None if plan.tp > 1 else bounds,
                                 expandable_segments=expandable_segments))
    best = {p.plan.to_compact(): size for p, size in zip(shown, sizes)}
    cpu_seconds["micro-batch"] = time.process_time() - started - sum(cpu_seconds.values())
    if not ranked:
        smallest = min(too_big, key=lambda p: p.reserved_bytes or p.peak_bytes, default=None)
        need = (f"; the smallest plan ({smallest.plan}) needs "
                f"{format_bytes(smallest.reserved_bytes or smallest.peak_bytes)}"
                if smallest else "")
        hint = "" if allow >= set(SEMANTIC) else " or --allow bf16,optimizer"
        raise UserError(f"no plan fits {format_bytes(budget_bytes)} with a {margin:.0%} margin "
                        f"on {gpus} GPU(s){need}: raise --budget, add --gpus{hint}")
    return SearchResult(ranked, rejected, too_big, len(plans), budget_bytes, usable, best,
                        cpu_seconds)


def group_by_layout(base: Baseline, hw: Hardware, plans: list[Plan], cache: dict
                    ) -> tuple[list, dict[tuple, list[int]]]:
    """(outcomes, by_layout): per plan None or (plan, why this machine or the plan's layout
    refuses it); the indexes of the others grouped by lifetime layout (plans sharing one
    are priced from the same transformed timeline)."""
    env = Environment(device_type=hw.device_type, bf16_supported=hw.bf16,
                      fp16_supported=hw.fp16, bitsandbytes_available=True)
    outcomes: list = [None] * len(plans)  #: per plan: its Prediction or (plan, why rejected)
    by_layout: dict[tuple, list[int]] = {}
    for index, plan in enumerate(plans):
        problems = environment_problems(plan, env)
        if problems:
            outcomes[index] = (plan, problems[0])
            continue
        coupled = split_refusal(base.batch_coupled, plan)
        if coupled:
            outcomes[index] = (plan, coupled)
            continue
        try:
            by_layout.setdefault(layout_key(base, plan, hw, cache), []).append(index)
        except PlanError as exc:
            outcomes[index] = (plan, str(exc))
    return outcomes, by_layout


def fast_pass(base: Baseline, hw: Hardware, plans: list[Plan], by_layout: dict,
              cache: dict, outcomes: list, *, only=None, keep=None, watch=None) -> set:
    """Every plan's peak from its layout's bounds (``quick_simulate``; a replay where the
    bounds cannot express it), one lifetime layout at a time: a layout's bounds are dropped
    once its plans are priced, and the timelines of steps 0-3 in ``cache`` once the last
    layout built on them is done (layouts sharing them run in a row), so memory holds one
    layout, not all of them.  The figures do not depend on the order.  Returns the keys of
    every such ``cache`` entry.  ``only(order, needs)``: the layouts to price, of those in
    running order (the dashboard's worker shares them among processes); ``keep``: what
    of each prediction to keep (default all of it); ``watch(indices, entries, cache)``:
    told each layout's plans once they are priced, before its timelines may be dropped
    (``TwinStages`` keeps the few that the tensor-parallel plans will replay)."""
    needs = {key: layout_cache_keys(base, plans[indices[0]], hw, cache)
             for key, indices in by_layout.items()}
    order = sorted(by_layout, key=lambda k: repr(needs[k]))
    if only is not None:
        order = only(order, needs)
    users = Counter(entry for key in order for entry in needs[key])
    for key in order:
        bounds: dict = {}
        for index in by_layout[key]:
            plan = plans[index]
            try:
                prediction = quick_simulate(base, plan, hw, cache, bounds) or simulate(
                    base, plan, hw, run_allocator=False, cache=cache, categories=False)
                outcomes[index] = keep(prediction) if keep else prediction
            except PlanError as exc:
                outcomes[index] = (plan, str(exc))
        if watch is not None:
            watch(by_layout[key], needs[key], cache)
        for entry in needs[key]:
            users[entry] -= 1
            if not users[entry]:
                cache.pop(entry, None)
    return set(users)


def _in_layout_order(base: Baseline, hw: Hardware, plans: list[Plan], cache: dict,
                     entries: set, work) -> list:
    """``[work(plan) for plan in plans]``, run with the plans that share the cached timelines
    of steps 0-3 in a row and only those timelines kept in ``cache`` (``entries``: every such
    key ``fast_pass`` knows)."""
    keys = [layout_cache_keys(base, plan, hw, cache) for plan in plans]
    results: list = [None] * len(plans)
    for index in sorted(range(len(plans)), key=lambda i: repr(keys[i])):
        for entry in entries.difference(keys[index]):
            cache.pop(entry, None)
        entries.update(keys[index])
        results[index] = work(plans[index])
    return results


class _LastLayout(dict):
    """A ``bounds_cache`` that keeps the last layout's bounds only (plans sharing a layout
    run in a row): asked for another layout, it lets the last one go before that one is
    built."""

    def get(self, key, default=None):
        if key not in self:
            self.clear()
        return super().get(key, default)


def _complexity(plan: Plan) -> int:
    default = Plan()
    return sum(getattr(plan, key) != getattr(default, key) for key in (
        "precision", "checkpoint", "accum", "shard", "hybrid", "optimizer")) + len(plan.offload)
