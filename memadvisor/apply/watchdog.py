"""Stop a run that stopped making progress: ``apply --timeout S``.

A rank stuck in the script's own code (a deadlock, a wait on a file or a peer that never
comes) leaves torchrun waiting forever: its peers sit in a collective whose own timeout
is long, or none.  Progress is an optimizer step (any ``torch.optim`` optimizer, which
every plan's loop and framework ends a step with); with none for ``timeout_s`` seconds
the rank says where its main thread is, records the failure where torch elastic's
launcher reads it (so the launcher names this rank) and exits 124, as ``timeout`` does.
"""
from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from pathlib import Path

EXIT_TIMEOUT = 124
_PACKAGE = str(Path(__file__).resolve().parents[1])
_TORCH = f"{os.sep}torch{os.sep}"
_DISTRIBUTED = f"{os.sep}torch{os.sep}distributed{os.sep}"
#: a rank waiting in a collective reports this much later than a rank stuck elsewhere, so
#: the launcher names the rank that stopped first (error files keep whole seconds)
VICTIM_GRACE_S = 3.0


def where_main_thread_is() -> tuple[str, bool]:
    """Where the main thread is -> (``file:line`` of its innermost frame outside
    memadvisor and torch, with the torch function it is in; whether it waits in a
    torch.distributed call, i.e. for another rank)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "an unknown place", False
    frames = traceback.extract_stack(frame)
    in_collective = any(_DISTRIBUTED in f.filename for f in frames[-12:])
    users = [f for f in frames
             if not f.filename.startswith(_PACKAGE) and _TORCH not in f.filename]
    last = (users or frames)[-1]
    where = f"{Path(last.filename).name}:{last.lineno}"
    innermost = frames[-1]
    if innermost is not last:
        where += f" (in {innermost.name})"
    return where, in_collective


class ProgressWatchdog:
    """Watch for optimizer steps; ``on_expire(message)`` when none came for long."""

    def __init__(self, timeout_s: float, on_expire, *, clock=time.monotonic,
                 poll_s: float = 0.5):
        self.timeout_s = timeout_s
        self.on_expire = on_expire
        self.steps = 0
        self._clock = clock
        self._poll_s = min(poll_s, timeout_s / 4)
        self._last_progress = clock()
        self._handle = None
        self._stopped = threading.Event()

    def _stepped(self, *_) -> None:
        self.steps += 1
        self._last_progress = self._clock()

    def message(self, where: str, in_collective: bool) -> str:
        after = f"after step {self.steps}" if self.steps else "before the first step"
        what = "waiting for the other ranks" if in_collective else "stuck"
        return (f"no optimizer step for {self.timeout_s:g} s {after}: {what} at {where} "
                f"(raise --timeout if a step is this slow)")

    def _watch(self) -> None:
        while not self._stopped.wait(self._poll_s):
            if self._clock() - self._last_progress > self.timeout_s:
                where, in_collective = where_main_thread_is()
                if in_collective and self._stopped.wait(VICTIM_GRACE_S):
                    return
                if self._clock() - self._last_progress > self.timeout_s:
                    self.on_expire(self.message(where, in_collective))
                    return

    def __enter__(self) -> "ProgressWatchdog":
        from torch.optim.optimizer import register_optimizer_step_post_hook
        self._handle = register_optimizer_step_post_hook(self._stepped)
        self._last_progress = self._clock()
        threading.Thread(target=self._watch, daemon=True, name="memadvisor-watchdog").start()
        return self

    def __exit__(self, *exc) -> None:
        self._stopped.set()
        if self._handle is not None:
            self._handle.remove()


def end_the_rank(message: str) -> None:
    """What an expired watchdog does: one line, the failure recorded, exit 124 -- from
    the watchdog's thread, while the main thread may be blocked in C."""
    rank = os.environ.get("RANK")
    prefix = f"[rank{rank}] " if rank is not None and os.environ.get("WORLD_SIZE") else ""
    print(f"{prefix}memadvisor: error: {message}", file=sys.stderr, flush=True)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        from torch.distributed.elastic.multiprocessing.errors import get_error_handler

        from ..errors import UserError
        try:
            get_error_handler().record_exception(UserError(message))
        except Exception:  # noqa: BLE001 - the exit matters more than the record
            pass
    sys.stderr.flush()
    from ..profile.crash import real_exit
    real_exit(EXIT_TIMEOUT)  # not a profiled script's os._exit: its checkpoint stands
