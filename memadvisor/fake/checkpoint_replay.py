"""A checkpointed call's recompute gets the answers its forward got.

Fake execution answers what it cannot compute -- a value-dependent length
(``torch.where(mask)``), a scalar read -- from the profiled run's values at that line, in
call order (``recorded_sizes.py``).  Under activation checkpointing the same lines run
again in backward (the recompute), and ``torch.utils.checkpoint`` insists the recompute
makes tensors of the shapes the forward made; the next recorded value is not that
(zoo/moe checkpoint=auto stopped with "Recomputed values ... have different metadata").
A real recompute reads the same data as its forward, so it gets the same answers.

Each non-reentrant checkpoint call (``torch.utils.checkpoint``'s
``_checkpoint_without_reentrant_generator``, what ``checkpoint(..., use_reentrant=False)``
and memadvisor's checkpoint plans run) is a *segment*: the answers given while its
forward runs are kept in order, and its recompute takes them back in that order.  Nested
checkpoints each have their own.  The reentrant variant is not followed (its recompute
gets fresh answers, as before).
"""
from __future__ import annotations

import threading

from .patching import Patches

_local = threading.local()


class Segment:
    """One checkpointed call: the answers its forward got, and how many its recompute took."""

    __slots__ = ("answers", "replaying", "taken")

    def __init__(self):
        self.answers: list[tuple[object, object]] = []
        self.replaying = False
        self.taken = 0

    def next_answer(self, func):
        """The answer the forward got for this call of ``func`` (None: none kept)."""
        if self.taken < len(self.answers):
            kept_func, answer = self.answers[self.taken]
            if kept_func is func:
                self.taken += 1
                return answer
        return None


def _stack() -> list:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def active() -> Segment | None:
    """The innermost checkpointed call running now (forward or recompute), if any."""
    stack = _stack()
    return stack[-1] if stack else None


def replayed(func):
    """The forward's answer for ``func`` when a recompute is running, else None."""
    segment = active()
    return segment.next_answer(func) if segment is not None and segment.replaying else None


def keep(func, answer) -> None:
    """Keep ``answer`` for the recompute, when a checkpointed forward is running."""
    segment = active()
    if segment is not None and not segment.replaying:
        segment.answers.append((func, answer))


def install() -> Patches:
    import torch.utils.checkpoint as checkpoint_module
    patches = Patches()
    original = checkpoint_module._checkpoint_without_reentrant_generator

    def replaying(fn, segment: Segment):
        def recompute(*args, **kwargs):
            segment.replaying, segment.taken = True, 0
            _stack().append(segment)
            try:
                return fn(*args, **kwargs)
            finally:
                _stack().pop()
        return recompute

    def generator(fn, *args, **kwargs):
        segment = Segment()
        inner = original(replaying(fn, segment), *args, **kwargs)
        next(inner)  # the checkpoint's set-up, before the forward
        _stack().append(segment)
        try:
            yield
        finally:
            _stack().pop()
        try:
            next(inner)  # after the forward
        except StopIteration:
            pass

    patches.set(checkpoint_module, "_checkpoint_without_reentrant_generator", generator)
    return patches
