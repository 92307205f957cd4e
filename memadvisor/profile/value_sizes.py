"""Record how many elements the script's value-dependent ops returned, and the scalar
values it read, by source line, for fake runs of the same script
(``fake/recorded_sizes.py`` says why and how they are answered)."""
from __future__ import annotations

import math
import sys

import torch

from ..fake.recorded_sizes import line_key, reader_key

#: calls kept per line (a long run repeats the pattern of its first steps)
MAX_CALLS_PER_LINE = 4096


class ValueSizes:
    """``key -> [[length, upper bound], ...]`` of one real run, in call order; ``install``
    wraps the Python entry points (``torch.where(cond)``, ``nonzero``, ``argwhere``,
    ``masked_select``, functions and methods) so that either engine records them -- the
    native engine sees no op in Python, and these are rare calls."""

    def __init__(self):
        self.calls: dict[str, list[list[int]]] = {}
        self._undo: list = []

    def record(self, key: str, length: int, bound: int) -> None:
        if not key:
            return
        calls = self.calls.setdefault(key, [])
        if len(calls) < MAX_CALLS_PER_LINE:
            calls.append([int(length), int(bound)])

    def _caller(self) -> str:
        frame = sys._getframe(2)
        return line_key(frame.f_code.co_filename, frame.f_lineno)

    def _wrap(self, owner, name: str, length_of) -> None:
        original = getattr(owner, name)

        # not functools.wraps: its __wrapped__ leads inspect to the builtin, and code that
        # asks inspect for the file of what it calls (seen under a zero1 profile) fails
        def wrapper(*args, **kwargs):
            out = original(*args, **kwargs)
            try:
                measured = length_of(args, kwargs, out)
                if measured is not None:
                    self.record(self._caller(), *measured)
            except Exception:  # noqa: BLE001 - recording never breaks the script
                pass
            return out

        wrapper.__name__ = wrapper.__qualname__ = name
        wrapper.__doc__ = original.__doc__
        # TorchScript compiles a scripted function's call of torch.where by looking the
        # function up among aten's builtins (ZeroRedundancyOptimizer scripts functional
        # optimizers on import): the wrapper is that builtin too
        from torch.jit import _builtins
        builtin = _builtins._find_builtin(original)
        if builtin is not None:
            _builtins._register_builtin(wrapper, builtin)
        setattr(owner, name, wrapper)
        self._undo.append((owner, name, original))

    def install(self) -> None:
        for owner in (torch, torch.Tensor):
            self._wrap(owner, "nonzero", _selected_rows)
            self._wrap(owner, "argwhere", _selected_rows)
            self._wrap(owner, "masked_select", _selected_elements)
        self._wrap(torch, "where", _where_one_argument)

    def uninstall(self) -> None:
        while self._undo:
            owner, name, original = self._undo.pop()
            setattr(owner, name, original)


#: the Python entry points of a scalar read (each ends in aten's _local_scalar_dense)
READ_METHODS = ("item", "__bool__", "__float__", "__int__", "__index__")
#: values kept per line, and lines kept
MAX_READS_PER_LINE = 4096
MAX_READ_LINES = 256


class ValueReads:
    """``key -> [value, ...]`` of one real run's scalar reads (``item()``, ``bool(t)``,
    ``float(t)``, ``int(t)``), in call order, by the line that read them
    (``recorded_sizes.reader_key``)."""

    def __init__(self):
        self.values: dict[str, list] = {}
        self._undo: list = []

    def _wrap(self, name: str) -> None:
        original = getattr(torch.Tensor, name)
        own = name in torch.Tensor.__dict__  # else inherited from TensorBase: restored by del
        values = self.values

        def wrapper(tensor, *args, **kwargs):
            out = original(tensor, *args, **kwargs)
            try:
                if isinstance(out, (bool, int, float)) and _real(tensor):
                    key = reader_key(2)
                    calls = values.get(key)
                    if calls is None and key and len(values) < MAX_READ_LINES:
                        calls = values[key] = []
                    if calls is not None and len(calls) < MAX_READS_PER_LINE:
                        calls.append(out if math.isfinite(out) else None)
            except Exception:  # noqa: BLE001 - recording never breaks the script
                pass
            return out

        wrapper.__name__ = wrapper.__qualname__ = name
        wrapper.__doc__ = original.__doc__
        setattr(torch.Tensor, name, wrapper)
        self._undo.append((name, original if own else None))

    def install(self) -> None:
        for name in READ_METHODS:
            self._wrap(name)

    def uninstall(self) -> None:
        while self._undo:
            name, original = self._undo.pop()
            if original is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, original)


def _real(tensor) -> bool:
    # a fake run's placeholder is no measurement (FakeTensor has fake_mode)
    return isinstance(tensor, torch.Tensor) and not hasattr(tensor, "fake_mode") \
        and tensor.device.type != "meta"


def _selected_rows(args, kwargs, out):
    source = args[0] if args else None
    if kwargs.get("as_tuple") or not _real(out) or not isinstance(source, torch.Tensor):
        return None
    return out.shape[0], source.numel()


def _selected_elements(args, kwargs, out):
    if not _real(out) or len(args) < 2:
        return None
    mask = args[1] if len(args) > 1 else kwargs.get("mask")
    return out.numel(), torch.Size(torch.broadcast_shapes(args[0].shape, mask.shape)).numel()


def _where_one_argument(args, kwargs, out):
    if len(args) != 1 or kwargs or not isinstance(out, tuple) or not out \
            or not _real(out[0]):
        return None
    return out[0].numel(), args[0].numel()


