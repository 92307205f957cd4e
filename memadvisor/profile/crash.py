"""How a profiled run ends when it does not end normally.

- ``SignalsHeld``: while the trace is being written, a second Ctrl-C or a SIGTERM is noted,
  not obeyed -- an interrupted write would lose the whole run.
- ``CrashWitness``: the script calling ``os._exit`` gets its trace written first (only in
  the profiled process: a forked child's ``os._exit`` is its own business); a segfault
  prints the Python stack (faulthandler) -- the trace of the steps before it was written
  at the step boundaries (checkpoint.py); a forked child (DataLoader workers,
  multiprocessing) gets back the SIGTERM handler the script had, not the profiler's.
"""
from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
from pathlib import Path

#: (pid of the profiled process, the profiler's SIGTERM handler, the one to give forked
#: children instead) while a script is profiled; os.register_at_fork cannot be undone, so
#: one hook reads this
_sigterm_for_children: list = []

#: os._exit itself, whoever patches it later (CrashWitness does)
real_exit = os._exit


def _reset_sigterm_in_child() -> None:
    if _sigterm_for_children:
        pid, ours, handler = _sigterm_for_children[-1]
        # a handler the script installed since is the script's: left alone
        if pid != os.getpid() and signal.getsignal(signal.SIGTERM) is ours:
            try:
                signal.signal(signal.SIGTERM, handler)
            except (ValueError, OSError, TypeError):  # not the main thread of the child
                pass
        _sigterm_for_children.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_sigterm_in_child)


def give_children_sigterm(ours, previous) -> None:
    """Forked children of this process get ``previous`` as their SIGTERM handler where
    they would inherit ``ours``."""
    _sigterm_for_children[:] = [(os.getpid(), ours, previous)]


def stop_giving_children_sigterm() -> None:
    _sigterm_for_children.clear()


class SignalsHeld:
    """``hold()``: from then on SIGINT and SIGTERM are noted, not obeyed, until
    ``release()`` (main thread only; a signal someone set to be ignored stays ignored)."""

    def __init__(self, output: Path):
        self.output = output
        self.received: list[int] = []
        self._saved: dict[int, object] = {}

    def _note(self, signum, frame) -> None:
        if not self.received:
            print(f"memadvisor: still writing the trace to {self.output}; it will be kept",
                  file=sys.stderr, flush=True)
        self.received.append(signum)

    def hold(self) -> None:
        if self._saved or threading.current_thread() is not threading.main_thread():
            return
        for signum in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(signum) is not signal.SIG_IGN:
                self._saved[signum] = signal.signal(signum, self._note)

    def release(self) -> None:
        for signum, handler in self._saved.items():
            signal.signal(signum, handler)
        self._saved = {}


class CrashWitness:
    """Around the script's run: ``os._exit`` writes the trace first; faulthandler on."""

    def __init__(self, session, script: Path, args: list[str], output: Path):
        self.session = session
        self.script = script
        self.args = args
        self.output = output
        self._pid = os.getpid()
        self._real_exit = real_exit
        self._faulthandler_was_on = True

    def _exit(self, code: int) -> None:
        if os.getpid() == self._pid:
            self._write_before_exit(code)
        self._real_exit(code)

    def _write_before_exit(self, code) -> None:
        from ..trace.io import write_trace
        os._exit = self._real_exit  # once: a failure below must not loop
        error = f"the script called os._exit({code!r})"
        try:
            if threading.current_thread() is threading.main_thread():
                table, meta = self.session.build(script=str(self.script), args=self.args,
                                                 status="error", error=error, probes=False)
            else:  # the main thread is still running the script: do not unhook it
                table, meta = self.session.snapshot(script=str(self.script), args=self.args,
                                                    status="error", error=error)
            write_trace(self.output, table, meta)
            print(f"memadvisor: {error}; wrote {self.output} ({meta.steps_completed} steps)",
                  file=sys.stderr, flush=True)
        except BaseException as exc:  # noqa: BLE001 - the exit must happen regardless
            print(f"memadvisor: {error}; could not write {self.output} "
                  f"({type(exc).__name__}: {exc})", file=sys.stderr, flush=True)

    def __enter__(self) -> "CrashWitness":
        os._exit = self._exit
        self._faulthandler_was_on = faulthandler.is_enabled()
        if not self._faulthandler_was_on:
            try:
                faulthandler.enable()
            except (RuntimeError, ValueError, OSError):  # no usable stderr
                self._faulthandler_was_on = True
        return self

    def __exit__(self, *exc) -> None:
        if os._exit == self._exit:
            os._exit = self._real_exit
        if not self._faulthandler_was_on:
            faulthandler.disable()
