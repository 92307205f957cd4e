"""The dashboard's plan panel as plain data: the simulator's ranking for a budget and a
number of GPUs, and any one plan's prediction with the terms it is made of.

The same calls ``memadvisor advise`` and ``memadvisor simulate`` make, split where the
budget enters (``simulate.ranking``): every candidate plan is priced once per number of
GPUs, and a budget's ranking is a filter and sort of those prices plus the allocator model
of the plans shown, each plan's kept for the next budget.  So a row of the table is the
number ``advise`` prints, and a new budget costs the allocator model of plans not shown
before.

All of it runs in one worker (``PlanAdvisor.worker``): a process forked once the trace is
read (a thread where there is no fork), so a simulation neither holds the server's
interpreter lock while a click is answered nor leaves its memory in the server.  Pricing
starts before the page is served, a page asks for a ranking and waits as long as it likes
(``wait_s``), and the timeline and tables never wait for it.  One worker does every
simulation, so memory holds one simulation at a time, whatever the number of requests.
"""
from __future__ import annotations

import itertools
import multiprocessing
import os
import signal
import threading
import time
from collections import OrderedDict
from concurrent.futures import (BrokenExecutor, CancelledError, Future, ProcessPoolExecutor,
                                ThreadPoolExecutor)
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import UserError
from ..plan import Plan
from ..report.build import decimate_pairs
from ..report.plans import SHOWN_OVER_BUDGET, timeline_pairs
from ..trace.io import Trace
from ..units import format_bytes

#: rankings, priced GPU counts and plan details kept (least recently used dropped)
KEPT_RANKINGS = 64
KEPT_PRICES = 4
KEPT_DETAILS = 32
#: processes that price the plans for a number of GPUs (the worker and ones it forks)
PRICING_PROCESSES = 2
#: the worker prefetches only after this long without a job someone asked for
PREFETCH_AFTER_IDLE_S = 1.0


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
            pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork"),
                                       initializer=_worker_started, initargs=((),))
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
            if self._after_job is not None:
                self._after_job()


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
    price_exactly(priced, plans)
    return [priced.exact[plan.to_compact()] for plan in plans]


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
    without a traceback of its own), the worker dies with the server, and it holds none of
    the server's sockets."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
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
    memory.bound_malloc()


class PlanAdvisor:
    """The simulator bound to one trace and one target GPU, run by one background worker."""

    def __init__(self, trace: Trace, gpu: str | None = None, *,
                 after_job: Callable[[], None] | None = None, fork: bool = True,
                 close_in_worker: tuple[int, ...] = ()):
        """``fork``: run the simulator in a forked process where the system can (else on a
        thread); ``close_in_worker``: file descriptors the worker closes (the server's
        listening socket)."""
        from ..simulate import hardware

        self.trace = trace
        # an unknown --gpu is a UserError now, before the server starts
        self.hardware = hardware(gpu, trace.meta.device)
        self._key = next(_KEYS)
        forking = fork and "fork" in multiprocessing.get_all_start_methods()
        _SIMULATORS[self._key] = Simulator(
            trace, self.hardware, after_job, key=self._key,
            pricing_processes=min(PRICING_PROCESSES, os.cpu_count() or 1) if forking else 1)
        if forking:
            # the simulation modules are imported before the fork, not by the worker
            from ..simulate import ranking, simulator  # noqa: F401
            from ..simulate import output  # noqa: F401
            from .. import verify  # noqa: F401
            self.worker = ProcessPoolExecutor(
                max_workers=1, mp_context=multiprocessing.get_context("fork"),
                initializer=_worker_started, initargs=(tuple(close_in_worker),))
            # forked now, from the thread building the dashboard (it lives as long as the
            # server: the worker is told to die with it)
            self.worker.submit(int).result()
        else:
            self.worker = ThreadPoolExecutor(max_workers=1,
                                             thread_name_prefix="memadvisor-plans")
        self._rankings: _Kept = _Kept(KEPT_RANKINGS)  # (budget, gpus) -> Future[PlanRanking]
        self._details = _Kept(KEPT_DETAILS)  # plan spec -> detail dict
        self._lock = threading.RLock()
        self._asked: set[Future] = set()  # jobs someone waits for: ahead of any prefetch
        self._last: tuple[int, int] | None = None  # the last (budget, GPUs) asked for
        self._wake = threading.Event()
        self._last_asked = time.monotonic()
        self._closed = False
        self._prefetcher: threading.Thread | None = None

    def _submit(self, method: str, *args, asked: bool = True) -> Future:
        future = self.worker.submit(_job, self._key, method, *args)
        if asked:
            with self._lock:
                self._asked.add(future)
                self._last_asked = time.monotonic()
            future.add_done_callback(self._answered)
        return future

    def _answered(self, future: Future) -> None:
        with self._lock:
            self._asked.discard(future)
            self._last_asked = time.monotonic()
        self._wake.set()

    def prefetch_in_background(self) -> None:
        """While nobody waits for the worker, have it make the allocator model of the plans
        other budgets would show, those nearest the last budget asked for first, one plan a
        job (a new ranking waits for one plan at most).  Started by the command; what is
        shown does not depend on it, only how soon."""
        if self._prefetcher is None:
            self._prefetcher = threading.Thread(target=self._prefetch_loop, daemon=True,
                                                name="memadvisor-prefetch")
            self._prefetcher.start()

    def _prefetch_loop(self) -> None:
        while not self._closed:
            self._wake.wait()
            self._wake.clear()
            while not self._closed:
                with self._lock:
                    busy, last = bool(self._asked), self._last
                    quiet_s = time.monotonic() - self._last_asked
                if busy or last is None:
                    break  # woken again when the jobs asked for are done
                if quiet_s < PREFETCH_AFTER_IDLE_S:
                    # someone is editing: a job started now would hold up their next one
                    if self._wake.wait(PREFETCH_AFTER_IDLE_S - quiet_s):
                        self._wake.clear()
                    continue
                try:
                    left = self._submit("prefetch", *last, asked=False).result()
                except (BrokenExecutor, CancelledError, RuntimeError):
                    return  # the worker is gone or shut down
                with self._lock:
                    moved = self._last != last
                if not left and not moved:
                    break

    def price_in_background(self, num_gpus: int) -> Future:
        """Start pricing every plan for ``num_gpus`` (what any budget's ranking needs)."""
        return self._submit("price", int(num_gpus))

    def priced_gpus(self) -> list[int]:
        """The numbers of GPUs the worker holds prices for."""
        return self._submit("priced_gpus").result()

    def request(self, budget_bytes: int, num_gpus: int = 1) -> Future:
        """The ranking's future, computed once per (budget, GPUs) by the worker; a request
        not yet started when a newer one comes is dropped (nobody waits for it long)."""
        key = (int(budget_bytes), int(num_gpus))
        with self._lock:
            future = self._rankings.get(key)
            if future is not None and not future.cancelled():
                self._rankings.move_to_end(key)
                return future
            for other, queued in list(self._rankings.items()):
                if queued.cancel():
                    del self._rankings[other]
            self._last = key
            future = self._submit("rank", *key)
            self._rankings.use(key, lambda: future)
            return future

    def rank(self, budget_bytes: int | None, num_gpus: int = 1,
             wait_s: float | None = None) -> PlanRanking | None:
        """The ranking for the budget; None while it is still being made after ``wait_s``
        seconds (None: wait for it)."""
        if not budget_bytes:
            return PlanRanking(None, num_gpus, message="enter a budget per GPU to rank plans")
        try:
            future = self.request(budget_bytes, num_gpus)
            return future.result(timeout=wait_s)
        except (FutureTimeout, CancelledError):
            return None
        except BrokenExecutor as exc:
            return PlanRanking(budget_bytes, num_gpus,
                               message=f"no plans: the plan worker stopped ({exc})")

    def detail(self, plan_spec: str) -> dict[str, Any]:
        """One plan's prediction (``simulate --json``'s keys) plus ``timeline``: its
        predicted live bytes as (event position in the step, bytes), thinned for drawing.
        Made by the worker, after the rankings asked for before it."""
        # the spec comes from the page: a spec, never a path the server would open
        spec = Plan.parse_spec(plan_spec).to_compact()
        with self._lock:
            known = self._details.get(spec)
        if known is not None:
            return known
        data = self._submit("detail", plan_spec).result()
        with self._lock:
            self._details.use(spec, lambda: data)
        return data

    def close(self) -> None:
        """Stop the worker now, in the middle of a job if need be (the server is going)."""
        self._closed = True
        self._wake.set()
        _end(self.worker)  # a forked worker is ended, not waited for (and its helper)
        _SIMULATORS.pop(self._key, None)


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
