"""``advise`` split where the budget enters, for a caller that ranks one trace for many
budgets (the dashboard): ``price_plans`` does the budget-independent work once -- every
candidate plan and its fast-pass peak -- and ``rank`` turns it into ``advise``'s result for
one budget: the plans whose fast peak fits, in ``rank_key`` order, then the allocator model
for the plans shown (reserved memory must fit too).

The same public calls, in the same order, as ``search.advise``, so ``rank(price_plans(...),
budget)`` has ``advise(..., budget)``'s ``ranked``, ``too_big``, ``rejected`` and
``evaluated`` (tests/ui compares them).  Two differences, both invisible in those: no
largest micro-batch (``max_micro_batch`` stays empty: the dashboard does not show it), and
each plan's allocator model runs once to its end and is kept without its timeline, so a
later budget reuses it; where the end differs from ``advise``'s early stop (a plan whose
reserved memory passes the usable bytes), the plan is priced again with that stop.

``shown_somewhere`` lists the plans some budget's ranking would show and ``price_exactly``
makes their allocator model ahead of time: a caller with time to spare (the dashboard's
idle worker) makes later budgets a filter and a sort.
"""
from __future__ import annotations

import dataclasses
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import UserError
from ..plan import Plan
from .hardware import Hardware
from .search import (SEMANTIC, SearchResult, add_model_parallel, candidate_plans, fast_pass,
                     group_by_layout, rank_key, twin_stages)
from .simulator import Baseline, Prediction, layout_cache_keys, simulate


@dataclass
class PricedPlans:
    """Every candidate plan for one trace, target and number of GPUs, priced once."""

    base: Baseline
    hw: Hardware
    gpus: int
    allow: frozenset[str]
    objective: str
    expandable_segments: bool
    plans: list[Plan]
    #: per plan, in candidate order: its fast-pass Prediction or (plan, why it cannot run)
    outcomes: list
    #: plan (compact) -> the allocator model run to its end, without its timeline
    exact: dict[str, Prediction] = field(default_factory=dict, repr=False)
    #: ``simulate``'s cache: the timelines of the last layout priced exactly (only those)
    cache: dict = field(default_factory=dict, repr=False)
    stage_keys: set = field(default_factory=set, repr=False)
    #: optional: starts the allocator model of some plans elsewhere (another process) and
    #: returns a future of their predictions, so that a ranking shares the work with it
    helper: Callable[[list[Plan]], Any] | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def evaluated(self) -> int:
        return len(self.plans)


def price_plans(base: Baseline, hw: Hardware, gpus: int = 1, *, allow: set[str] | None = None,
                objective: str = "cost", expandable_segments: bool = False,
                part: tuple[int, int] = (0, 1)) -> PricedPlans:
    """``advise``'s candidates and fast pass, which no budget changes.

    ``part=(i, n)``: price only the ``i``-th of ``n`` shares of the lifetime layouts (in
    the order they run, about as many plans each; the other plans' outcomes stay None), for
    ``n`` processes to share the work; ``merge_parts`` puts the shares together."""
    allow = set(allow or ())
    rank_key(objective)  # an unknown objective is a UserError now, not at the first budget
    unknown = allow - set(SEMANTIC)
    if unknown:
        raise UserError(f"--allow takes {', '.join(SEMANTIC)}; got {', '.join(sorted(unknown))}")
    plans = candidate_plans(base, gpus, allow, hw)
    cache: dict = {}
    outcomes, by_layout = group_by_layout(base, hw, plans, cache)
    def mine(order: list, needs: dict) -> list:
        if part[1] == 1:
            return order
        shared = _share([needs[k][0] for k in order], *part)
        return [k for k in order if needs[k][0] in shared]

    whole = part[1] == 1  # shares: tp and pp plans once merged (their choice needs all figures)
    watch = twin_stages(base, hw, gpus, allow, objective, plans, outcomes) if whole else None
    stage_keys = fast_pass(base, hw, plans, by_layout, cache, outcomes, only=mine,
                           keep=_without_timeline, watch=watch)
    if whole:
        add_model_parallel(base, hw, gpus, allow, objective, plans, outcomes, cache,
                           stage_keys, keep=_without_timeline, held=watch)
    # the exact pass goes on with this cache (what else it holds: each plan's regions), as
    # ``advise``'s does
    return PricedPlans(base, hw, gpus, frozenset(allow), objective, expandable_segments, plans,
                       outcomes, cache=cache, stage_keys=stage_keys)


def _share(stages: list, index: int, count: int) -> set:
    """The ``index``-th of ``count`` shares of the layouts, by the first timeline they
    build (layouts sharing it stay together: it is made once): the stages that most
    layouts use go first, each to the share with the fewest layouts so far."""
    uses = Counter(repr(stage) for stage in stages)
    loads = [0] * count
    mine = set()
    for stage, layouts in sorted(uses.items(), key=lambda item: (-item[1], item[0])):
        least = loads.index(min(loads))
        loads[least] += layouts
        if least == index:
            mine.add(stage)
    return {stage for stage in stages if repr(stage) in mine}


def merge_parts(priced: PricedPlans, *others: list) -> PricedPlans:
    """``priced`` (one share) with the outcomes of the other shares filled in."""
    for outcomes in others:
        for index, outcome in enumerate(outcomes):
            if priced.outcomes[index] is None:
                priced.outcomes[index] = outcome
    missing = sum(outcome is None for outcome in priced.outcomes)
    if missing:
        raise ValueError(f"{missing} plans priced by no share")
    add_model_parallel(priced.base, priced.hw, priced.gpus, set(priced.allow),
                       priced.objective, priced.plans, priced.outcomes, priced.cache,
                       priced.stage_keys, keep=_without_timeline)
    return priced


def rank(priced: PricedPlans, budget_bytes: int, *, margin: float = 0.05, top: int = 10,
         misses_shown: int = 3) -> SearchResult:
    """``advise(base, hw, budget_bytes, gpus, ...)`` from plans priced once (without the
    largest micro-batch); UserError, as ``advise``, when no plan fits.  ``misses_shown``:
    the first plans of ``too_big`` whose figures must be ``advise``'s to the byte."""
    from ..units import format_bytes

    if not 0 <= margin < 1:
        raise UserError(f"the safety margin must be between 0 and 1, got {margin}")
    usable = int(budget_bytes * (1 - margin))
    key = rank_key(priced.objective)
    rejected, fitting, too_big = [], [], []
    for outcome in priced.outcomes:  # in candidate order, as ties in the ranking are broken
        if isinstance(outcome, tuple):
            rejected.append(outcome)
        else:
            (fitting if outcome.peak_bytes <= usable else too_big).append(outcome)
    fitting.sort(key=key)
    # the allocator model for the best plans: reserved memory must fit too
    exact = priced.hw.device_type == "cuda"
    ranked: list[Prediction] = []
    taken = 0
    while len(ranked) < top and taken < len(fitting):
        batch = fitting[taken:taken + top - len(ranked)]
        taken += len(batch)
        for prediction in _exact_in_layout_order(priced, [p.plan for p in batch], exact):
            if exact and (prediction.reserved_bytes or prediction.peak_bytes) > usable:
                # ``advise`` stopped this plan's allocator model once reserved memory
                # passed ``usable``: a miss shown carries the figures of that stop
                if len(too_big) < misses_shown:
                    prediction = _stopped_at(priced, prediction.plan, usable)
                too_big.append(prediction)
                continue
            ranked.append(prediction)
    # the same order as the fast pass, after the allocator model has dropped plans whose
    # reserved memory does not fit
    ranked.sort(key=key)
    if not ranked:
        smallest = min(too_big, key=lambda p: p.reserved_bytes or p.peak_bytes, default=None)
        need = (f"; the smallest plan ({smallest.plan}) needs "
                f"{format_bytes(smallest.reserved_bytes or smallest.peak_bytes)}"
                if smallest else "")
        hint = "" if priced.allow >= set(SEMANTIC) else " or --allow bf16,optimizer"
        raise UserError(f"no plan fits {format_bytes(budget_bytes)} with a {margin:.0%} margin "
                        f"on {priced.gpus} GPU(s){need}: raise --budget, add --gpus{hint}")
    return SearchResult(ranked, rejected, too_big, priced.evaluated, budget_bytes, usable)


def _exact_in_layout_order(priced: PricedPlans, plans: list[Plan],
                           run_allocator: bool) -> list[Prediction]:
    """Each plan's full prediction (kept in ``priced.exact``), the plans sharing cached
    timelines in a row and only their timelines kept in ``priced.cache``."""
    base, hw = priced.base, priced.hw
    cache, stage_keys = priced.cache, priced.stage_keys
    results: list = [None] * len(plans)
    todo = []
    with priced._lock:
        for index, plan in enumerate(plans):
            known = priced.exact.get(plan.to_compact())
            if known is not None:
                results[index] = known
            else:
                todo.append(index)
    keys = {index: layout_cache_keys(base, plans[index], hw, cache) for index in todo}
    helped = None
    if priced.helper is not None and len(todo) > 1:
        # half the layouts (plans sharing timelines stay together) to the helper
        theirs = _share([keys[index] for index in todo], 1, 2)
        given = [index for index in todo if keys[index] in theirs]
        if given:
            helped = (given, priced.helper([plans[index] for index in given]))
            todo = [index for index in todo if keys[index] not in theirs]
    for index in sorted(todo, key=lambda i: repr(keys[i])):
        for entry in stage_keys.difference(keys[index]):
            cache.pop(entry, None)
        stage_keys.update(keys[index])
        prediction = _without_timeline(simulate(
            base, plans[index], hw, run_allocator=run_allocator,
            expandable_segments=priced.expandable_segments, cache=cache))
        results[index] = prediction
        with priced._lock:
            priced.exact[plans[index].to_compact()] = prediction
    if helped is not None:
        given, future = helped
        for index, prediction in zip(given, future.result()):
            results[index] = prediction
            with priced._lock:
                priced.exact[plans[index].to_compact()] = prediction
    return results


def _stopped_at(priced: PricedPlans, plan: Plan, usable: int) -> Prediction:
    return _without_timeline(simulate(
        priced.base, plan, priced.hw, run_allocator=True,
        expandable_segments=priced.expandable_segments, cache=priced.cache,
        allocator_stop_above=usable))


def shown_somewhere(priced: PricedPlans, budget_bytes: int, *, margin: float = 0.05,
                    top: int = 10) -> list[Plan]:
    """The plans some budget's ranking would show whose allocator model is not made yet,
    those nearest ``budget_bytes`` first: a plan is among the best ``top`` for the budget
    whose usable bytes are its fast peak when fewer than ``top`` better-ranked plans have a
    peak as small (fewer still, where the allocator model drops some).  What a caller with
    time to spare prices (``price_exactly``) so that a later budget finds it made."""
    import numpy as np

    predictions = sorted((o for o in priced.outcomes if not isinstance(o, tuple)),
                         key=rank_key(priced.objective))
    if not predictions or priced.hw.device_type != "cuda":
        return []
    peaks = np.array([p.peak_bytes for p in predictions], dtype=np.float64)
    better_and_smaller = np.tril(peaks[None, :] <= peaks[:, None], k=-1).sum(axis=1)
    usable = max(budget_bytes * (1 - margin), 1.0)
    distance = np.abs(np.log(np.maximum(peaks, 1.0) / usable))
    order = [i for i in np.argsort(distance, kind="stable") if better_and_smaller[i] < top]
    with priced._lock:
        return [predictions[i].plan for i in order
                if predictions[i].plan.to_compact() not in priced.exact]


def release(priced: PricedPlans) -> None:
    """Drop the layout timelines kept for the next exact pass (a caller between jobs keeps
    its memory to the prices and the models made)."""
    with priced._lock:
        for entry in priced.stage_keys:
            priced.cache.pop(entry, None)
        priced.stage_keys.clear()


def price_exactly(priced: PricedPlans, plans: list[Plan]) -> None:
    """The allocator model of ``plans``, kept for the rankings that show them."""
    _exact_in_layout_order(priced, plans, priced.hw.device_type == "cuda")


def _without_timeline(prediction: Prediction) -> Prediction:
    """The prediction without its per-event timeline (what a ranking needs, kept small)."""
    return dataclasses.replace(prediction, timeline=None)
