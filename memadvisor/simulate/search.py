"""``advise``: enumerate plans, drop the impossible, predict the rest, rank by step time.

Plans are every combination of knobs that ``plan.Plan`` accepts and the target hardware
can run (``candidates``).  Techniques that change training semantics (``bf16``, an optimizer
swap) are enumerated only when allowed.  Every candidate gets the fast pass (peak of
requested bytes from its lifetime layout's bounds, ``bounds.LayoutBounds``; the layouts one
at a time, ``fast_pass``, so memory holds one of them); the allocator model (reserved
memory) runs for every plan shown (the best ``top`` that fit).  A plan fits when its
reserved (or, without an allocator, peak) bytes are at most ``budget * (1 - margin)``.
Tensor- and pipeline-parallel plans, which the bounds cannot express, are replayed exactly,
a few per degree chosen from the fast pass's figures of their twins
(``add_model_parallel``).
"""
from __future__ import annotations

import dataclasses
import time
from collections import Counter
from dataclasses import dataclass, field

from ..errors import UserError
from ..plan import Environment, Plan, PlanError, environment_problems
from ..units import format_bytes
from .batch_coupling import split_refusal
from .candidates import (EXACT_PER_DEGREE, SEMANTIC, candidate_plans, degree, estimated,
                         model_parallel_candidates, rank_key)
from .hardware import Hardware
from .simulator import (Baseline, Prediction, layout_cache_keys, layout_key, max_micro_batch,
                        quick_simulate, simulate)

__all__ = ["SEMANTIC", "SearchResult", "add_model_parallel", "advise", "candidate_plans",
           "fast_pass", "group_by_layout", "rank_key", "twin_stages"]


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


class TwinStages:
    """A ``fast_pass`` watcher that keeps the model-stage timelines (steps 0-2 and 0-3) of
    the twins ``add_model_parallel`` will pick -- per degree, the best twin so far under
    the objective and the leanest so far, where ``candidates.estimated`` places their
    plans -- so that those tp and pp plans, which share the twin's layout, are replayed
    without making those timelines again (the precision and checkpoint rewrites are most
    of a replay's time).  At most two per degree are held beyond the layout being priced;
    a guess that turns out wrong only costs that time."""

    def __init__(self, plans: list[Plan], outcomes: list, pairs: list[tuple[Plan, Plan]],
                 key):
        planned: dict[str, list[Plan]] = {}
        for plan, twin in pairs:
            planned.setdefault(twin.to_compact(), []).append(plan)
        worlds = {twin.world for _, twin in pairs}
        # the cheap tests first: most of the thousands of plans are no twin
        self.planned = {index: planned[plan.to_compact()] for index, plan in enumerate(plans)
                        if plan.world in worlds and plan.hybrid is None and not plan.offload
                        and plan.to_compact() in planned}
        self.pairs, self.outcomes, self.key = pairs, outcomes, key
        self.best: dict[tuple, tuple] = {}  #: (degree, role) -> (rank, entries)
        self.held: dict[tuple, object] = {}  #: cache entry -> its timeline

    def __call__(self, indices: list[int], entries: tuple, cache: dict) -> None:
        changed = False
        for index in indices:
            planned = self.planned.get(index)
            outcome = self.outcomes[index] if planned else None
            if outcome is None or isinstance(outcome, tuple):
                continue
            for plan in planned:
                figures = estimated(plan, outcome)
                rank = self.key(figures)
                # the ends of ``_front_picks``' front: first in rank, least peak (ties: rank)
                for role, order in (("best", rank), ("leanest", (figures.peak_bytes, rank))):
                    known = self.best.get((degree(plan), role))
                    if known is None or order < known[0]:
                        self.best[(degree(plan), role)] = (order, entries[:2])
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
    """The ``fast_pass`` watcher for ``add_model_parallel``'s picks; None without tp or pp
    plans."""
    pairs = model_parallel_candidates(base, gpus, allow, hw)
    if not pairs:
        return None
    return TwinStages(plans, outcomes, pairs, rank_key(objective))


def add_model_parallel(base: Baseline, hw: Hardware, gpus: int, allow: set[str],
                       objective: str, plans: list[Plan], outcomes: list, cache: dict,
                       stage_keys: set, keep=None, held: TwinStages | None = None,
                       usable_bytes: int | None = None, shown: int = 10,
                       ruled_out: list | None = None) -> list[Plan]:
    """Append to ``plans`` and ``outcomes`` the tensor- and pipeline-parallel plans worth
    replaying, with their exact predictions (``simulate`` without the allocator model; the
    layout bounds know nothing of tp or pp).  Per degree at most ``EXACT_PER_DEGREE``,
    chosen from their twins' fast-pass figures (``outcomes`` of the plans without tp or
    pp, as ``candidates.estimated`` places them) and no budget: ``_front_picks``.  A plan
    whose twin is not a candidate (GPUs/degree not a candidate world) is not tried.  With
    ``usable_bytes`` (advise's budget) a degree is not replayed where ``shown`` plans without
    model parallelism surely fit and its twins say none of the degree's plans can rank
    among them (the list advise shows, and the dashboard's, stay the same): a replay per
    stage costs what a fast pass of hundreds of plans does.  The picks left out are
    appended to ``ruled_out`` (they count as evaluated: by their twins)."""
    pairs = held.pairs if held is not None else model_parallel_candidates(base, gpus, allow, hw)
    if not pairs:
        return []
    key = rank_key(objective)
    bar = (_surely_fitting_nth(plans, outcomes, usable_bytes, key, shown)
           if usable_bytes is not None and objective != "memory" else None)
    chosen = _front_picks(pairs, _priced_twins(plans, outcomes, pairs), key, hw, bar,
                          ruled_out if ruled_out is not None else [])

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


def _priced_twins(plans: list[Plan], outcomes: list, pairs: list[tuple[Plan, Plan]]
                  ) -> dict[str, Prediction]:
    """plan (compact) -> its fast-pass prediction, for the plans that may be twins."""
    worlds = {twin.world for _, twin in pairs}
    return {plan.to_compact(): outcome for plan, outcome in zip(plans, outcomes)
            if plan.world in worlds and plan.hybrid is None and not plan.offload
            and outcome is not None and not isinstance(outcome, tuple)}


#: a fast-pass peak this far under the budget fits once the allocator model has rounded it
#: into blocks and segments too (reserved over allocated, with room)
SURE_FIT = 1.15
#: how much better than its twins' estimate a model-parallel plan may turn out, in the
#: objective (tp's all-reduces are left out of it; a stage holds less than its twin)
ESTIMATE_SLACK = 1.10


def _surely_fitting_nth(plans: list[Plan], outcomes: list, usable_bytes: int, key,
                        n: int):
    """The objective (``key``'s first figure) of the ``n``-th best plan so far whose peak
    fits ``usable_bytes`` with ``SURE_FIT`` to spare; None if fewer than ``n`` do."""
    figures = sorted(key(outcome)[0] for outcome in outcomes
                     if outcome is not None and not isinstance(outcome, tuple)
                     and outcome.peak_bytes * SURE_FIT <= usable_bytes)
    return figures[n - 1] if n >= 1 and len(figures) >= n else None


def _front_picks(pairs: list[tuple[Plan, Plan]], priced: dict[str, Prediction], key,
                 hw: Hardware, bar: float | None = None, ruled_out: list | None = None
                 ) -> list[Plan]:
    """Per degree (tp, then pp, each ascending), ``EXACT_PER_DEGREE`` plans from the
    Pareto front of the objective against peak bytes that their priced twins make: its
    best plan, its leanest and evenly between -- so any budget finds the plan its twins
    say fits best.  A degree whose best estimate is worse than ``bar`` (a surely fitting
    plan's objective) by more than ``ESTIMATE_SLACK`` is left out (its picks appended to
    ``ruled_out``)."""
    env = Environment(device_type=hw.device_type, bf16_supported=hw.bf16,
                      fp16_supported=hw.fp16, bitsandbytes_available=True)
    by_degree: dict[tuple[int, int], list] = {}
    for plan, twin in pairs:
        figures = priced.get(twin.to_compact())
        if figures is not None and not environment_problems(plan, env):
            by_degree.setdefault(degree(plan), []).append((plan, estimated(plan, figures)))
    chosen: list[Plan] = []
    for entries in by_degree.values():  # in the pairs' order: tp's degrees, then pp's
        entries.sort(key=lambda entry: key(entry[1]))
        picks = _even_picks(entries)
        if bar is not None and key(entries[0][1])[0] > bar * ESTIMATE_SLACK:
            if ruled_out is not None:
                ruled_out += picks
            continue
        chosen += picks
    return chosen


def _even_picks(entries: list) -> list[Plan]:
    """``EXACT_PER_DEGREE`` plans of ``entries`` (sorted by the objective): the ends of their
    Pareto front of the objective against peak bytes and evenly between."""
    front = []
    for entry in entries:
        if not front or entry[1].peak_bytes < front[-1][1].peak_bytes:
            front.append(entry)
    last = len(front) - 1
    picks = sorted({round(i * last / max(EXACT_PER_DEGREE - 1, 1))
                    for i in range(EXACT_PER_DEGREE)})
    return [front[i][0] for i in picks]


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
    ruled_out: list[Plan] = []  #: model-parallel picks their twins' estimates ruled out
    outcomes, by_layout = group_by_layout(base, hw, plans, cache)
    watch = twin_stages(base, hw, gpus, allow, objective, plans, outcomes)
    stage_keys = fast_pass(base, hw, plans, by_layout, cache, outcomes, watch=watch)
    cpu_seconds = {"fast pass": time.process_time() - started}
    add_model_parallel(base, hw, gpus, allow, objective, plans, outcomes, cache, stage_keys,
                       held=watch, usable_bytes=usable, shown=top, ruled_out=ruled_out)
    cpu_seconds["model parallel"] = time.process_time() - started - cpu_seconds["fast pass"]
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
                             lambda plan: _pipeline_micro_batch(
                                 base, plan, hw, usable, cache) if plan.pp > 1 else
                             max_micro_batch(
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
    return SearchResult(ranked, rejected, too_big, len(plans) + len(ruled_out), budget_bytes,
                        usable, best, cpu_seconds)


#: replays at most for a pp plan's largest micro-batch (``_pipeline_micro_batch``)
PIPELINE_SIZE_RUNS = 8


def _pipeline_micro_batch(base: Baseline, plan: Plan, hw: Hardware, usable_bytes: int,
                          cache: dict) -> int:
    """The largest pipeline micro-batch of a pp plan (shown, so its own fits) whose worst
    stage fits, each size replayed by ``simulate`` (``max_micro_batch`` bisects the whole
    model's timeline, not a stage's): doubling from the plan's own, then halving the gap,
    at most ``PIPELINE_SIZE_RUNS`` replays -- the largest size verified, smaller than the
    true answer at worst, never one that does not fit.  A pp plan's reserved figure is its
    peak (no allocator model per stage), so the peak decides."""
    low, high = plan.micro_batch_size(base.batch_size), None
    for _ in range(PIPELINE_SIZE_RUNS):
        if high is not None and high - low <= 1:
            break
        size = 2 * low if high is None else (low + high) // 2
        peak = simulate(base, plan, hw, micro_batch=size, run_allocator=False, cache=cache,
                        categories=False).peak_bytes
        low, high = (size, high) if peak <= usable_bytes else (low, size)
    return low


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

