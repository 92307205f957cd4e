"""A real run's value-dependent lengths, answered to a fake run of the same script.

``nonzero`` (``torch.where(mask)``), ``argwhere`` and ``masked_select`` make a result whose
length is a property of the data: a mixture-of-experts router's tokens per expert, a
mask's kept positions.  Fake execution cannot compute it and answers the largest length
possible (every element selected), which for a router sends every token to every expert
(zoo/moe: executed +92..152% over the real run).  The real profile records, per source
line, each call's length and the largest it could have been (``profile/value_sizes.py``,
``meta.extra['value_sizes']``); a fake run of the same script under a plan (verify)
answers each call with the same selected share of its own upper bound, in the recorded
order (a plan changes the micro-batch, not what the data selects).

Lines are keyed by their text (stripped), not number: the script verify runs is apply's
rewrite, whose line numbers differ.

The same holds for scalar reads (``item()``, ``bool(t)``, ``float(t)``): a fake tensor has no
value, and a loop whose exit reads one (LBFGS's ``if opt_cond: break`` between closure
calls: zoo/lbfgs_sine ran one closure call of its four, -50% against the real run) follows
the placeholder.  The real profile records each read's value by the line that read it
(``meta.extra['value_reads']``: the innermost frame that is not torch's dispatch plumbing,
so LBFGS's own line inside torch.optim); a fake run of the same script answers each read
at that line with the recorded values in order (:class:`RecordedReads`), so it takes the
branches the real run took.
"""
from __future__ import annotations

import linecache
import os
import sys

import torch

_aten = torch.ops.aten
TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
# all of memadvisor: the profiler's dispatch mode sits between a script and fake mode too
MEMADVISOR_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
#: torch frames that only carry a read to the fake mode (dispatch, tensor printing): a read
#: through them alone is the script's own (``loss.item()``, ``print(loss)``)
TORCH_PLUMBING = tuple(TORCH_DIR + name for name in (
    "_subclasses" + os.sep, "utils" + os.sep + "_stats.py",
    "utils" + os.sep + "_python_dispatch.py", "_ops.py", "_tensor.py", "_tensor_str.py",
    "_compile.py", "_dynamo" + os.sep))  # the last two: torch._disable_dynamo's wrappers
#: frames that only carry a read, for ``reader_key``: the reader is the frame that called
#: them (``__torch_function__`` overrides carry one too)
PLUMBING = (MEMADVISOR_DIR,) + TORCH_PLUMBING + (TORCH_DIR + "overrides.py",)


def upper_bound(func, args) -> int:
    """The largest length ``func(*args)`` can return: every element selected."""
    source = args[0]
    if func is _aten.masked_select.default:
        return int(torch.Size(torch.broadcast_shapes(source.shape, args[1].shape)).numel())
    return int(source.numel())


def line_key(filename: str, line: int) -> str:
    """The key of a source line: its text, stripped ('' where the file cannot be read)."""
    return linecache.getline(filename, line).strip() if filename and line else ""


def reader_key(depth: int = 1) -> str:
    """The line key of the innermost frame above the caller's ``depth`` that is neither this
    package nor torch's plumbing: the line that read a value."""
    frame = sys._getframe(depth)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(PLUMBING) and not filename.startswith("<frozen"):
            return line_key(filename, frame.f_lineno)
        frame = frame.f_back
    return ""


class _ByLine:
    """Recorded items per line key, handed out in call order (cycling: a longer run repeats
    the recorded pattern)."""

    def __init__(self, items: dict):
        self._items = items
        self._next: dict[str, int] = {}

    def __bool__(self) -> bool:
        return bool(self._items)

    def _take(self, key: str):
        items = self._items.get(key)
        if not items:
            return None
        at = self._next.get(key, 0)
        self._next[key] = at + 1
        return items[at % len(items)]


class RecordedReads(_ByLine):
    """Answers a fake run's scalar reads from the real run's values at the same line."""

    def __init__(self, reads: dict | None):
        super().__init__({key: values for key, values in (reads or {}).items()
                          if isinstance(values, list) and values})

    def value(self, key: str, dtype: torch.dtype):
        """The next recorded value read at ``key``, as ``dtype``'s Python type (None: the
        line was not recorded)."""
        value = self._take(key)
        if not isinstance(value, (bool, int, float)):
            return None
        if dtype == torch.bool:
            return bool(value)
        if dtype.is_floating_point:
            return float(value)
        if dtype.is_complex:
            return complex(value)
        return int(value)


class RecordedShares(_ByLine):
    """Answers a fake run's value-sized op from the real run's calls at the same line."""

    def __init__(self, calls: dict | None):
        super().__init__({key: [length / bound if bound else 0.0 for length, bound in pairs]
                          for key, pairs in (calls or {}).items() if pairs})

    def length(self, key: str, bound: int) -> int | None:
        """The length for the next call at ``key`` with upper bound ``bound`` (None: the
        line was not recorded)."""
        share = self._take(key)
        if share is None:
            return None
        return min(bound, max(0, round(share * bound)))
