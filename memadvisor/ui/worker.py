"""The dashboard's plan worker: a process forked from the server once the trace is read
(``plans.PlanAdvisor`` starts it and asks it for work), holding the simulator's baseline of
the trace, its plans priced per number of GPUs, and the helper processes it forks to share
a pricing or a ranking.  Everything here runs in the worker (or a thread, where there is no
fork); the server side only submits ``_job``s.
"""
from __future__ import annotations

import gc
import itertools
import multiprocessing
import multiprocessing.util
import os
import signal
from collections import OrderedDict
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import UserError
from ..plan import Plan
from ..report.build import decimate_pairs
from ..report.plans import SHOWN_OVER_BUDGET, timeline_pairs
from ..trace.io import Trace
from ..units import format_bytes

#: priced GPU counts kept (least recently used dropped)
KEPT_PRICES = 4
#: processes that price the plans for a number of GPUs (the worker and ones it forks)
PRICING_PROCESSES = 2
#: how much nicer than the server the worker and its helpers run
WORKER_NICE = 5
try:  # the niceness of the process that imported this (the server)
    _server_nice = os.getpriority(os.PRIO_PROCESS, 0)
except (OSError, AttributeError):
    _server_nice = 0


@dataclass
class PlanRanking:
    """What the plan table shows for one (budget, GPUs): fitting plans best first, then
    the nearest misses.  ``message`` says why there are none, or what to know."""

    budget_bytes: int | None
    num_gpus: int
    rows: list[dict[str, Any]] = field(default_factory=list)
    message: str = ""


class _Kept(OrderedDict):
    """A dict that keeps its ``limit`` most recently used entries."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit

    def use(self, key, make: Callable[[], Any]):
        if key in self:
            self.move_to_end(key)
            return self[key]
        value = self[key] = make()
        while len(self) > self.limit:
            self.popitem(last=False)
        return value


class Simulator:
    """The worker's side: the trace's baseline, its plans priced per number of GPUs, and
    the rankings and predictions made from them."""

    def __init__(self, trace: Trace, hw, after_job: Callable[[], None] | None = None, *,
                 key: int = 0, pricing_processes: int = 1):
        self.trace = trace
        self.hardware = hw
        self.key = key  # its entry in ``_SIMULATORS``
        self.pricing_processes = pricing_processes
        self._helping: tuple[int, ProcessPoolExecutor] | None = None
        self._after_job = after_job  # e.g. give freed memory back (``memory.trim``)
        self._base = None
        self._base_error: str | None = None
        self._priced = _Kept(KEPT_PRICES)  # gpus -> PricedPlans or the UserError text

    def baseline(self):
        """The simulator's ``prepare`` of the trace (UserError when it refuses it)."""
        from ..verify import baseline_as_applied

        if self._base is None and self._base_error is None:
            try:
                self._base = baseline_as_applied(self.trace)
            except UserError as exc:
                self._base_error = str(exc)
        if self._base_error is not None:
            raise UserError(self._base_error)
        return self._base

    def prices(self, num_gpus: int):
        def make():
            try:
                priced = self._price(self.baseline(), num_gpus)
            except UserError as exc:
                return str(exc)
            if self.pricing_processes > 1:
                priced.helper = lambda plans: self._helper(num_gpus).submit(
                    _exact_part, self.key, num_gpus, plans)
            return priced

        priced = self._priced.use(num_gpus, make)
        if isinstance(priced, str):
            raise UserError(priced)
        return priced

    def _price(self, base, num_gpus: int):
        """Every plan priced, the work shared with ``pricing_processes - 1`` processes
        forked from this one (they start with the baseline made)."""
        from ..simulate.ranking import merge_parts, price_plans

        shares = self.pricing_processes
        if shares < 2:
            return price_plans(base, self.hardware, num_gpus)
        with ProcessPoolExecutor(shares - 1, mp_context=multiprocessing.get_context("fork"),
                                 initializer=_worker_started, initargs=((),)) as helpers:
            others = [helpers.submit(_price_part, self.key, num_gpus, (index, shares))
                      for index in range(1, shares)]
            mine = price_plans(base, self.hardware, num_gpus, part=(0, shares))
            return merge_parts(mine, *(other.result() for other in others))

    def _helper(self, num_gpus: int) -> ProcessPoolExecutor:
        """A process forked from this one once the plans for ``num_gpus`` are priced, that
        makes half the allocator models a ranking needs (one at a time: a new number of
        GPUs replaces it)."""
        if self._helping is not None and self._helping[0] != num_gpus:
            _end(self._helping[1])
            self._helping = None
        if self._helping is None:
            gc.freeze()  # as the server before forking this worker
            pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork"),
                                       initializer=_worker_started, initargs=((),))
            # ended before this worker's own exit joins its children (it would wait for
            # the idle helper forever)
            multiprocessing.util.Finalize(pool, _end, args=(pool,), exitpriority=10)
            self._helping = (num_gpus, pool)
        return self._helping[1]

    def price(self, num_gpus: int) -> None:
        try:
            self.prices(num_gpus)
        except UserError:
            pass  # the ranking says why

    def priced_gpus(self) -> list[int]:
        return list(self._priced)

    def rank(self, budget_bytes: int, num_gpus: int) -> PlanRanking:
        from ..simulate.ranking import rank

        try:
            priced = self.prices(num_gpus)
            result = rank(priced, budget_bytes, misses_shown=SHOWN_OVER_BUDGET)
        except UserError as exc:  # no complete step, or no plan fits: say so in the panel
            return PlanRanking(budget_bytes, num_gpus, message=f"no plans: {exc}")
        rows = ([plan_row(p, True) for p in result.ranked]
                + [plan_row(p, False) for p in result.too_big[:SHOWN_OVER_BUDGET]])
        misses = ", then the nearest misses" if result.too_big else ""
        message = (f"{result.evaluated} plans evaluated for {num_gpus} GPU(s) of "
                   f"{format_bytes(budget_bytes)} (usable {format_bytes(result.usable_bytes)}"
                   f" with the 5% margin): {len(result.ranked)} that fit, fastest first"
                   f"{misses}")
        return PlanRanking(budget_bytes, num_gpus, rows, message)

    def prefetch(self, budget_bytes: int, num_gpus: int, count: int = 1) -> int:
        """Price exactly the next ``count`` plans some budget would show (those nearest
        ``budget_bytes`` first); returns how many are left."""
        from ..simulate.ranking import price_exactly, shown_somewhere

        try:
            priced = self.prices(num_gpus)
        except UserError:
            return 0
        todo = shown_somewhere(priced, budget_bytes)
        price_exactly(priced, todo[:count])
        return max(len(todo) - count, 0)

    def advice(self) -> dict[str, Any]:
        """``advice.collect`` on the trace for the target, as ``advise`` lists it beside its
        plans: ``{"advice": [Advice as dicts], "note": '' or why there is none}``.  Run here
        because the worker holds the baseline the plans are priced from, and the trace's
        events (the server keeps its own for the timeline; neither drops them)."""
        from ..advice import advice_dicts, collect

        try:
            items = collect(self.trace, self.baseline(), self.hardware)
        except UserError as exc:  # no complete step: the panel says why
            return {"advice": [], "note": f"advice unavailable: {exc}"}
        return {"advice": advice_dicts(items), "note": ""}

    def detail(self, plan_spec: str) -> dict[str, Any]:
        from ..simulate import simulate
        from ..simulate.output import simulate_dict

        base = self.baseline()
        prediction = simulate(base, Plan.parse_spec(plan_spec), self.hardware)
        data = simulate_dict(base, prediction, self.hardware)
        pairs = timeline_pairs(prediction.timeline)
        data["timeline"] = decimate_pairs(pairs) if pairs else []
        return data

    def run(self, method: str, *args) -> Any:
        try:
            return getattr(self, method)(*args)
        finally:
            self.release()
            if self._after_job is not None:
                self._after_job()

    def release(self) -> None:
        """Between jobs, keep only the prices and the models made (no layout timelines)."""
        from ..simulate.ranking import release

        for priced in list(self._priced.values()):
            if not isinstance(priced, str):
                release(priced)


#: the simulators of this process by key: a forked worker finds its own here (it gets a
#: copy of the table as it was when forked, so nothing is pickled but the job's arguments)
_SIMULATORS: dict[int, Simulator] = {}
_KEYS = itertools.count()


def _job(key: int, method: str, *args) -> Any:
    return _SIMULATORS[key].run(method, *args)


def _exact_part(key: int, num_gpus: int, plans: list[Plan]) -> list:
    """In the helper process: the allocator models of ``plans`` (kept here too, so a
    later ranking's share may find them made)."""
    from ..simulate.ranking import price_exactly

    priced = _SIMULATORS[key].prices(num_gpus)
    priced.helper = None  # this process does its share itself
    try:
        price_exactly(priced, plans)
        return [priced.exact[plan.to_compact()] for plan in plans]
    finally:
        _SIMULATORS[key].release()
        from . import memory
        memory.trim()


def _end(pool: ProcessPoolExecutor) -> None:
    """End a process pool now, in the middle of a job if need be."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    for process in processes:
        process.terminate()
    # joined once ended (quick), so that nothing of it is left for the exit to close
    pool.shutdown(wait=bool(processes), cancel_futures=True)


def _price_part(key: int, num_gpus: int, part: tuple[int, int]) -> list:
    """In a process forked by the worker: one share of the plans' prices."""
    from ..simulate.ranking import price_plans

    simulator = _SIMULATORS[key]
    return price_plans(simulator.baseline(), simulator.hardware, num_gpus, part=part).outcomes


def _worker_started(close_fds: tuple[int, ...]) -> None:
    """In the forked worker: Ctrl-C is the server's to handle (the worker ends with it,
    without a traceback of its own), the worker dies with the server, it holds none of the
    server's sockets, and it yields the CPU to the server and the browser (``WORKER_NICE``
    above the server: the page is built and drawn first, the plans in the time left)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        now = os.getpriority(os.PRIO_PROCESS, 0)
        os.setpriority(os.PRIO_PROCESS, 0, max(now, _server_nice + WORKER_NICE))
    except (OSError, AttributeError):
        pass
    try:
        import ctypes
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: Linux
    except (OSError, AttributeError):
        pass
    for fd in close_fds:
        try:
            os.close(fd)
        except OSError:
            pass
    from . import memory
    memory.compute_malloc()  # it computes; ``trim`` after each job gives back what it freed


def plan_row(prediction, fits: bool) -> dict[str, Any]:
    """A table row: raw numbers for sorting and tests, text for reading."""
    from ..simulate import explain

    plan = prediction.plan
    reserved = prediction.reserved_bytes
    reserved = prediction.peak_bytes if reserved is None else int(reserved)
    return {"plan": plan.to_compact() or "none", "peak_bytes": int(prediction.peak_bytes),
            "reserved_bytes": reserved,
            "step_time_factor": round(float(prediction.step_time_factor), 4),
            "fits": "yes" if fits else "no",
            "peak": format_bytes(prediction.peak_bytes), "reserved": format_bytes(reserved),
            "step_time": f"x{prediction.step_time_factor:.3f}",
            "changes": "; ".join(explain.changes(plan))}
