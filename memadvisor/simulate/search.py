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

import itertools
import time
from collections import Counter
from dataclasses import dataclass, field

from ..errors import UserError
from ..plan import Environment, Plan, PlanError, environment_problems
from ..units import format_bytes
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


def candidate_plans(base: Baseline, gpus: int, allow: set[str], hw: Hardware) -> list[Plan]:
    precisions = ["fp32", "amp-bf16"]
    if hw.device_type == "cuda":
        precisions.append("amp-fp16")
    if "bf16" in allow:
        precisions.append("bf16")
    optimizers = ["keep"] + (["sgd", "sgd-momentum", "adafactor", "adam8bit"]
                             if "optimizer" in allow else [])
    checkpoints = ["none", "auto"] if base.blocks else ["none"]
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


#: what "best" means: ``cost`` GPU-time per step (step time x GPUs: a second GPU that
#: halves the step costs the same, and communication makes it cost more), ``speed`` wall
#: time per step (GPUs are free), ``memory`` the smallest peak
OBJECTIVES = ("cost", "speed", "memory")


def rank_key(objective: str):
    """The sort key of a prediction under ``objective``; ties go to the plan with fewer
    techniques, then the smaller peak."""
    if objective == "speed":
        return lambda p: (round(p.step_time_factor, 3), _complexity(p.plan), p.peak_bytes)
    if objective == "memory":
        return lambda p: (p.reserved_bytes or p.peak_bytes, round(p.step_time_factor, 3),
                          _complexity(p.plan))
    if objective == "cost":
        return lambda p: (round(p.step_time_factor * p.plan.world, 3), _complexity(p.plan),
                          p.peak_bytes)
    raise UserError(f"--objective takes {', '.join(OBJECTIVES)}; got {objective!r}")


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
    stage_keys = fast_pass(base, hw, plans, by_layout, cache, outcomes)
    cpu_seconds = {"fast pass": time.process_time() - started}
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
    sizes = _in_layout_order(base, hw, [p.plan for p in ranked[:3]], cache, stage_keys,
                             lambda plan: max_micro_batch(
                                 base, plan, hw, usable, cache=cache, bounds_cache=bounds,
                                 expandable_segments=expandable_segments))
    best = {p.plan.to_compact(): size for p, size in zip(ranked[:3], sizes)}
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
        try:
            by_layout.setdefault(layout_key(base, plan, hw, cache), []).append(index)
        except PlanError as exc:
            outcomes[index] = (plan, str(exc))
    return outcomes, by_layout


def fast_pass(base: Baseline, hw: Hardware, plans: list[Plan], by_layout: dict,
              cache: dict, outcomes: list, *, only=None, keep=None) -> set:
    """Every plan's peak from its layout's bounds (``quick_simulate``; a replay where the
    bounds cannot express it), one lifetime layout at a time: a layout's bounds are dropped
    once its plans are priced, and the timelines of steps 0-3 in ``cache`` once the last
    layout built on them is done (layouts sharing them run in a row), so memory holds one
    layout, not all of them.  The figures do not depend on the order.  Returns the keys of
    every such ``cache`` entry.  ``only(order, needs)``: the layouts to price, of those in
    running order (the dashboard's worker shares them among processes); ``keep``: what
    of each prediction to keep (default all of it)."""
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
