"""``apply --steps N``: stop the rewritten script after N optimizer steps, as ``profile``
stops a profiled one.

A step is one iteration of every optimizer the script steps: the run stops just before
the first optimizer it saw steps for the (N+1)th time, so each optimizer has made exactly
N updates (a GAN's discriminator and generator alike) and the parameters are what N full
iterations leave.  The stop is a ``BaseException``, so a script's ``except Exception``
does not swallow it.
"""
from __future__ import annotations

import contextlib
import sys


class StepsDone(BaseException):
    """The run made the optimizer steps asked for: a normal end."""


@contextlib.contextmanager
def stop_after(steps: int | None):
    """Within the block, stop the script (``StepsDone``) once ``steps`` steps are done;
    ``None``: run to its own end."""
    if not steps:
        yield
        return
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    counts: dict[int, int] = {}
    first: list[int] = []

    def before_step(optimizer, _args, _kwargs):
        key = id(optimizer)
        if not first:
            first.append(key)
        if key == first[0] and counts.get(key, 0) >= steps:
            print(f"memadvisor: stopping after {steps} optimizer step(s) (--steps)",
                  file=sys.stderr, flush=True)
            raise StepsDone()
        counts[key] = counts.get(key, 0) + 1

    handle = register_optimizer_step_pre_hook(before_step)
    try:
        yield
    except StepsDone:
        pass
    finally:
        handle.remove()
