"""What fake execution answers when a script reads a tensor's values.

A fake tensor has no data, so ``loss.item()``, ``t.tolist()``, ``bool(t)``,
``torch.allclose(a, b)`` and ``t.nonzero()`` cannot be computed.  Rather than stop the
script (FakeTensorMode raises), fake execution answers with a documented placeholder and
records where the script asked, so the profile can say which lines saw invented values:

    scalar reads (``item``, ``tolist`` elements, ``float(t)``, ``int(t)``)
        1.0 for floating and complex tensors, 1 for integer tensors, True for bool
        tensors.  One, not zero: ``if loss < target: break`` keeps training, and nothing
        divides by zero.  Except GradScaler's count of non-finite gradients: 0, so the
        optimizer steps (``FINITE_CHECKS``).
    ``bool(t)`` and ``if t:``: the tensor's scalar read, so True.
    ``torch.allclose`` / ``torch.equal``: True.
    ``nonzero`` / ``argwhere``: every element counted as non-zero (shape ``(numel, ndim)``),
    the largest result the real op could return, so memory is over-, never
    under-estimated.  ``masked_select``: ``(numel,)`` likewise.

A script whose control flow depends on these values (``while loss > eps``) runs the
branch the placeholder picks; the records let a report warn about each such line.  A loop
that the placeholder never ends is stopped: when one line has read a placeholder in more
than ``PlaceholderLog.loop_limit`` iterations since the last optimizer step,
:class:`DataDependentLoop` names it.  An *iteration* is a read with some other op run
since that line's previous read, so ``t.tolist()`` (one op, then a read per element) is
one, and a loop over a model's parameters reading each norm is one per parameter.
"""
from __future__ import annotations

import os
import sys
import threading
from collections import Counter
from dataclasses import dataclass

import torch

from . import checkpoint_replay
from .recorded_sizes import (MEMADVISOR_DIR, TORCH_DIR, TORCH_PLUMBING, line_key, reader_key,
                             upper_bound)

_aten = torch.ops.aten
_TORCH_DIR, _MEMADVISOR_DIR, _TORCH_PLUMBING = TORCH_DIR, MEMADVISOR_DIR, TORCH_PLUMBING

SCALAR_OPS = frozenset({_aten._local_scalar_dense.default})
#: torch functions whose scalar reads count non-finite gradients (GradScaler's
#: ``_maybe_opt_step`` sums ``found_inf``): they read 0, so the optimizer steps as in all
#: but a real run's first overflow steps; a 1 would skip every step, and the optimizer's
#: state, the largest part of a step's memory, would never exist
FINITE_CHECKS = frozenset({"torch.amp.grad_scaler:_maybe_opt_step"})
TRUE_OPS = frozenset({_aten.allclose.default, _aten.equal.default})
UPPER_BOUND_OPS = frozenset({_aten.nonzero.default, _aten.argwhere.default,
                             _aten.masked_select.default})


@dataclass(frozen=True, slots=True)
class PlaceholderUse:
    op: str
    """The aten op that needed real values (``aten._local_scalar_dense`` for item())."""
    location: str
    """``file:line`` of the script's frame that asked (first frame outside torch)."""
    value: str
    """What was answered."""
    inside_torch: str
    """The torch function that asked on the script's behalf (``torch.optim.adamw:adamw``
    reading its step count), or '' when the script's own line asked."""


def _is_internal(filename: str) -> bool:
    return (filename.startswith(_TORCH_DIR) or filename.startswith(_MEMADVISOR_DIR)
            or filename.startswith("<frozen"))


def script_location() -> str:
    """``file:line`` of the innermost frame outside torch and this package."""
    return _locate()[0]


def _locate() -> tuple[str, str]:
    """(script ``file:line``, the outermost torch function between it and here)."""
    frame = sys._getframe(1)
    torch_function = ""
    while frame is not None:
        filename = frame.f_code.co_filename
        if not _is_internal(filename):
            return f"{filename}:{frame.f_lineno}", torch_function
        if filename.startswith(_TORCH_DIR) and not filename.startswith(_TORCH_PLUMBING):
            module = filename[len(_TORCH_DIR):].removesuffix(".py").replace(os.sep, ".")
            torch_function = f"torch.{module}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "<unknown>", torch_function


def _innermost_torch_function() -> str:
    """``torch.<module>:<function>`` of the torch frame that asked for a value directly
    (below the dispatch plumbing), or ''."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith(_TORCH_DIR) and not filename.startswith(_TORCH_PLUMBING):
            # a comprehension (``sum(v.item() for v in ...)``) reads for its function
            while frame.f_code.co_name.startswith("<") and frame.f_back is not None \
                    and frame.f_back.f_code.co_filename == filename:
                frame = frame.f_back
            module = filename[len(_TORCH_DIR):].removesuffix(".py").replace(os.sep, ".")
            return f"torch.{module}:{frame.f_code.co_name}"
        if not _is_internal(filename):
            return ""
        frame = frame.f_back
    return ""


def scalar_placeholder(dtype: torch.dtype):
    if dtype == torch.bool:
        return True
    if dtype.is_floating_point:
        return 1.0
    if dtype.is_complex:
        return complex(1.0)
    return 1


class DataDependentLoop(BaseException):
    """A loop whose exit depends on tensor values that fake execution invents.

    A ``BaseException`` (like KeyboardInterrupt), so a script's ``except Exception`` does
    not swallow it and keep looping.  ``str()`` is one line naming the script's line."""

    def __init__(self, location: str, inside_torch: str, iterations: int):
        self.location, self.inside_torch, self.iterations = location, inside_torch, iterations
        via = f" (inside {inside_torch})" if inside_torch else ""
        super().__init__(f"{location}{via} reads tensor values in a loop that fake "
                         f"execution cannot end: {iterations:,} iterations without an "
                         f"optimizer step; fake tensors have no values (placeholders: "
                         f"item() = 1, bool() = True)")


class PlaceholderLog:
    """Every placeholder answered, in order (bounded: the first ``limit`` are kept, all are
    counted by location)."""

    #: iterations of one line's reads between two optimizer steps that mean "endless"
    #: (a training loop reading a few values per step, or one per parameter, stays far
    #: below; a data-dependent ``while`` reaches it in seconds)
    loop_limit = 10_000

    def __init__(self, limit: int = 10_000):
        self._lock = threading.Lock()
        self.limit = limit
        self.uses: list[PlaceholderUse] = []
        self.count_by_location: Counter[str] = Counter()
        #: location -> [iterations since the last step, ops_dispatched at its last read]
        self._iterations: dict[str, list[int]] = {}
        #: ops the fake mode ran other than reads (mode.py counts them)
        self.ops_dispatched = 0
        #: the lengths the real run's value-dependent ops returned, by line (verify passes
        #: the profiled trace's; ``profile/value_sizes.py``): answered instead of the bound
        self.recorded = None
        #: the scalar values the real run read, by line (``profile/value_sizes.py``)
        self.recorded_reads = None

    def record(self, op: str, value: object) -> None:
        location, inside_torch = _locate()
        with self._lock:
            self.count_by_location[location] += 1
            if len(self.uses) < self.limit:
                self.uses.append(PlaceholderUse(op, location, repr(value), inside_torch))
            seen = self._iterations.get(location)
            if seen is None:
                seen = self._iterations[location] = [0, -1]
            if seen[1] != self.ops_dispatched:
                seen[0] += 1
                seen[1] = self.ops_dispatched
            iterations = seen[0]
        if iterations > self.loop_limit:
            raise DataDependentLoop(location, inside_torch, iterations)

    def new_step(self) -> None:
        """An optimizer step ended: loops that read values once per step are fine."""
        with self._lock:
            self._iterations.clear()

    def busiest_location(self) -> tuple[str, int] | None:
        """The line with the most read iterations since the last step, and their count."""
        with self._lock:
            if not self._iterations:
                return None
            location, (iterations, _) = max(self._iterations.items(),
                                            key=lambda item: item[1][0])
            return location, iterations

    def locations(self) -> list[str]:
        """Distinct script lines that read placeholder values, most frequent first."""
        return [loc for loc, _ in self.count_by_location.most_common()]

    def script_reads(self) -> list[PlaceholderUse]:
        """The uses where the script's own line read a value (not torch on its behalf,
        like an optimizer reading its step count): the lines a report should warn about."""
        return [use for use in self.uses if not use.inside_torch]


def answer(func, args, kwargs, log: PlaceholderLog, empty):
    """The placeholder for ``func(*args, **kwargs)``, if it is one of the value-reading ops
    above; ``NotImplemented`` otherwise.  ``empty(shape, dtype, device)`` makes a fake
    tensor (the fake mode is not active inside its own dispatch)."""
    again = checkpoint_replay.replayed(func)  # a checkpoint's recompute: as its forward
    if again is not None:
        value = again
        if func in UPPER_BOUND_OPS:
            source = args[0]
            value = (empty((again,), source.dtype, source.device)
                     if func is _aten.masked_select.default else
                     empty((again, source.dim()), torch.long, source.device))
        log.record(str(func.overloadpacket), "the checkpointed forward's answer")
        return value
    if func in SCALAR_OPS:
        value = None
        if log.recorded_reads:
            # the value the real run read at this line (recorded_sizes.RecordedReads)
            value = log.recorded_reads.value(reader_key(1), args[0].dtype)
        if value is None:
            value = scalar_placeholder(args[0].dtype)
            if _innermost_torch_function() in FINITE_CHECKS:
                value = type(value)(0)  # gradients are finite: the step runs (FINITE_CHECKS)
    elif func in TRUE_OPS:
        value = True
    elif func in UPPER_BOUND_OPS:
        source = args[0]
        length = bound = upper_bound(func, args)
        recorded = None
        if log.recorded:
            filename, _, line = _locate()[0].rpartition(":")
            recorded = log.recorded.length(line_key(filename, int(line or 0)), bound)
        if recorded is not None:
            length = recorded
        if func is _aten.masked_select.default:
            value = empty((length,), source.dtype, source.device)
        else:
            value = empty((length, source.dim()), torch.long, source.device)
        checkpoint_replay.keep(func, length)
        log.record(str(func.overloadpacket),
                   f"upper bound {tuple(value.shape)}" if recorded is None else
                   f"the profiled run's share at this line: {length} of {bound}")
        return value
    else:
        return NotImplemented
    checkpoint_replay.keep(func, value)
    log.record(str(func.overloadpacket), value)
    return value
