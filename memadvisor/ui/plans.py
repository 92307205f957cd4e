"""The dashboard's plan panel as plain data: the simulator's ranking for a budget and a
number of GPUs, and any one plan's prediction with the terms it is made of.

The same calls ``memadvisor advise`` and ``memadvisor simulate`` make, split where the
budget enters (``simulate.ranking``): every candidate plan is priced once per number of
GPUs, and a budget's ranking is a filter and sort of those prices plus the allocator model
of the plans shown, each plan's kept for the next budget.  So a row of the table is the
number ``advise`` prints, and a new budget costs the allocator model of plans not shown
before.

All of it runs in one worker (``PlanAdvisor.worker``; its side is ``worker.py``): a
process forked once the trace is read (a thread where there is no fork), so a simulation
neither holds the server's interpreter lock while a click is answered nor leaves its memory
in the server.  Pricing starts before the page is served, a page asks for a ranking and
waits as long as it likes (``wait_s``), and the timeline and tables never wait for it.  One
worker does every simulation, so memory holds one simulation at a time, whatever the number
of requests.
"""
from __future__ import annotations

import gc
import multiprocessing
import os
import threading
import time
from concurrent.futures import (BrokenExecutor, CancelledError, Future, ProcessPoolExecutor,
                                ThreadPoolExecutor)
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable

from ..plan import Plan
from ..trace.io import Trace
from .worker import (_SIMULATORS, PRICING_PROCESSES, PlanRanking, Simulator, _end, _job,
                     _Kept, _KEYS, _worker_started, plan_row)

__all__ = ["PlanAdvisor", "PlanRanking", "plan_row"]

#: rankings and plan details kept (least recently used dropped)
KEPT_RANKINGS = 64
KEPT_DETAILS = 32
#: the worker prefetches only after this long without a job someone asked for
PREFETCH_AFTER_IDLE_S = 1.0


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
            # what the server holds now is left out of the child's garbage collection,
            # whose passes would write to (and so copy) every page of it
            gc.freeze()
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
        self._advice: Future | None = None  # ``advice_in_background``'s, once asked

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

    def hold_off(self) -> None:
        """Someone is using the page (a click, a pointer resting on the timeline): what
        the worker makes ahead waits another ``PREFETCH_AFTER_IDLE_S``, so that the CPU,
        shared with the browser, answers them first."""
        with self._lock:
            self._last_asked = time.monotonic()

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

    def advice_in_background(self) -> Future:
        """The advice beyond plans (``Simulator.advice``), made once by the worker after the
        jobs asked for before it (the first ranking: the page waits for that, not this)."""
        with self._lock:
            if self._advice is None or self._advice.cancelled():
                self._advice = self._submit("advice")
            return self._advice

    def advice(self, wait_s: float | None = None) -> dict[str, Any] | None:
        """``Simulator.advice``'s answer; None while it is still being made after
        ``wait_s`` seconds (None: wait for it)."""
        try:
            return self.advice_in_background().result(timeout=wait_s)
        except (FutureTimeout, CancelledError):
            return None
        except BrokenExecutor as exc:
            return {"advice": [], "note": f"advice unavailable: the plan worker stopped "
                                          f"({exc})"}

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
