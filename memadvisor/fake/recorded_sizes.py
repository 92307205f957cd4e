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
"""
from __future__ import annotations

import linecache

import torch

_aten = torch.ops.aten


def upper_bound(func, args) -> int:
    """The largest length ``func(*args)`` can return: every element selected."""
    source = args[0]
    if func is _aten.masked_select.default:
        return int(torch.Size(torch.broadcast_shapes(source.shape, args[1].shape)).numel())
    return int(source.numel())


def line_key(filename: str, line: int) -> str:
    """The key of a source line: its text, stripped ('' where the file cannot be read)."""
    return linecache.getline(filename, line).strip() if filename and line else ""


class RecordedShares:
    """Answers a fake run's value-sized op from the real run's calls at the same line."""

    def __init__(self, calls: dict | None):
        self._shares = {key: [length / bound if bound else 0.0 for length, bound in pairs]
                        for key, pairs in (calls or {}).items() if pairs}
        self._next: dict[str, int] = {}

    def __bool__(self) -> bool:
        return bool(self._shares)

    def length(self, key: str, bound: int) -> int | None:
        """The length for the next call at ``key`` with upper bound ``bound`` (None: the
        line was not recorded)."""
        shares = self._shares.get(key)
        if not shares:
            return None
        at = self._next.get(key, 0)
        self._next[key] = at + 1
        return min(bound, max(0, round(shares[at % len(shares)] * bound)))
