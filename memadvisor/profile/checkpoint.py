"""Keep the trace on disk while the script runs, so a run that dies without closing leaves
its completed steps.

``os._exit``, a segfault, the kernel's OOM killer or ``kill -9`` end the process with no
chance to write anything.  At step boundaries the trace so far is written to the output
(atomically, with status ``incomplete``), and the final write replaces it.  Writing costs
time linear in the events so far, so checkpoints are rationed: a free allowance (a short
run keeps every step) plus a fixed fraction of the run's time (a long one, a checkpoint
every so often, never more than that fraction of its time).
"""
from __future__ import annotations

import time
from pathlib import Path

#: checkpoints may take this much time for free (a short run: every step kept)
FREE_ALLOWANCE_S = 1.0
#: and beyond it at most this fraction of the run's time
TIME_FRACTION = 0.05

INCOMPLETE = "incomplete"


def incomplete_error(steps: int) -> str:
    return (f"the process ended without closing its trace (killed, os._exit or a crash); "
            f"the {steps} step{'s' if steps != 1 else ''} before that are kept")


class Checkpoint:
    """``Checkpoint(output, script, args)(session)`` at a step boundary: maybe write."""

    def __init__(self, output: Path, script: str, args: list[str], *,
                 clock=time.monotonic):
        self.output = output
        self.script = script
        self.args = args
        self._clock = clock
        self._started_s = clock()
        self.spent_s = 0.0
        self._last_cost_s = 0.0
        self.written_steps = 0  #: steps in the file on disk (0: nothing written yet)
        self.failed = ""  #: why the last write failed (the run goes on regardless)

    def due(self) -> bool:
        allowance_s = FREE_ALLOWANCE_S + TIME_FRACTION * (self._clock() - self._started_s)
        return self.spent_s + self._last_cost_s <= allowance_s

    def __call__(self, session) -> None:
        if not self.due():
            return
        from ..trace.io import write_trace
        started = self._clock()
        steps = len(session.boundaries()[1])
        try:
            table, meta = session.snapshot(script=self.script, args=self.args,
                                           status=INCOMPLETE, error=incomplete_error(steps))
            write_trace(self.output, table, meta)
            self.written_steps, self.failed = steps, ""
        except Exception as exc:  # noqa: BLE001 - a full disk, no memory, pyarrow's threads
            # whatever fails here must not end the script's run: the final write says so
            self.failed = f"{type(exc).__name__}: {exc}"[:200]
        finally:
            self._last_cost_s = self._clock() - started
            self.spent_s += self._last_cost_s
