"""Fewer layers of a deep model's repeated stack, for a verification that extrapolates.

Executing a plan on fake tensors costs a few hundred microseconds per op whatever the
tensors' sizes (docs/VERIFY.md): a 760-layer model costs 190 times a 4-layer one.  Where
a model repeats one layer N times -- ``nn.ModuleList(Block() for _ in range(N))``,
``nn.Sequential(*blocks)`` -- everything a training step allocates for it grows by the
same bytes per layer (its parameters, gradients, optimizer state, saved activations, its
FSDP unit), so a plan's peak is ``a + b x layers`` at a peak of the same kind.  The
verification runs the script with the stack cut to k = 2, 3 and 4 layers, checks that
the three peaks lie on one line, and extrapolates to N (``verify/execute.py``); what does
not lie on a line is executed in full instead.

A stack is a ModuleList or Sequential made with at least :data:`MIN_LAYERS` modules that
are alike: the same class, parameter and buffer shapes and dtypes, and printed form.  The
cut happens where the container is made, so the optimizer, ``mem.prepare`` and the
parallel wrappers only ever see the layers kept.  Layers built one by one with
``append`` are not cut (the count is not known until the last one); a script that reads
``layers[i]`` beyond the cut fails, and the verification runs in full.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterable

import torch.nn as nn

#: the least layers a container must repeat to be cut
MIN_LAYERS = 6


def _signature(module: nn.Module) -> tuple:
    return (type(module),
            tuple((name, tuple(p.shape), p.dtype) for name, p in module.named_parameters()),
            tuple((name, tuple(b.shape), b.dtype) for name, b in module.named_buffers()),
            repr(module))


def _alike(modules: list) -> bool:
    if len(modules) < MIN_LAYERS or not all(isinstance(m, nn.Module) for m in modules):
        return False
    first = modules[0]
    if any(m is first for m in modules[1:]):
        return False  # one layer applied N times (shared weights): not a stack of N
    signature = _signature(first)
    return all(_signature(m) == signature for m in modules[1:])


def _made_at() -> str:
    """file:line of the user's code that made the container."""
    torch_dir = nn.__file__.rsplit("/nn/", 1)[0]
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith(torch_dir)
                                 or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame else "?"


@contextmanager
def cut_stacks(keep: int, light_layers: Iterable[str] = ()):
    """Within: each stack made keeps its first ``keep`` layers.  Yields the list of stacks
    cut, each ``{"source", "layer", "layers"}`` (``layers``: how many the script made).
    ``light_layers``: names of layer classes the recorded model has one stack of; every
    instance after the first ``keep`` is built on the meta device (see
    :func:`_built_light`)."""
    stacks: list[dict] = []
    list_init, sequential_init = nn.ModuleList.__init__, nn.Sequential.__init__  # originals

    def cut(modules: list) -> list:
        if keep >= len(modules) or not _alike(modules):
            return modules
        stacks.append({"source": _made_at(), "layer": type(modules[0]).__name__,
                       "layers": len(modules)})
        return modules[:keep]

    def cut_list_init(self, modules=None):
        if modules is not None:
            modules = cut(list(modules))
        list_init(self, modules)

    def cut_sequential_init(self, *args):
        if len(args) > 1:
            args = tuple(cut(list(args)))
        sequential_init(self, *args)

    nn.ModuleList.__init__ = cut_list_init
    nn.Sequential.__init__ = cut_sequential_init
    try:
        with _built_light(set(light_layers), keep):
            yield stacks
    finally:
        nn.ModuleList.__init__ = list_init
        nn.Sequential.__init__ = sequential_init


@contextmanager
def _built_light(names: set[str], keep: int):
    """Within: each instance of a layer class named in ``names`` after its first ``keep``
    is built on the meta device with no dispatch mode on -- no fake tensor, nothing
    recorded: a stack cut to ``keep`` drops it at once, so building 760 layers of which 2
    stay costs what building 2 does (fake-tensor construction is ~0.4 ms per op).  Should
    it fail there (a layer that names its own device), it is built as the script says."""
    if not names:
        yield
        return
    import torch
    from torch.utils._python_dispatch import _disable_current_modes
    built: dict[type, int] = {}
    originals: dict[type, object] = {}

    def lighten(cls) -> None:
        if cls.__name__ not in names or cls in originals or "__init__" not in vars(cls):
            return
        original = originals[cls] = cls.__init__

        def init(self, *args, **kwargs):
            if type(self) is cls:
                count = built[cls] = built.get(cls, 0) + 1
                if count > keep:
                    try:
                        with _disable_current_modes(), torch.device("meta"):
                            return original(self, *args, **kwargs)
                    except Exception:  # noqa: BLE001 - built as the script says instead
                        pass
            return original(self, *args, **kwargs)

        cls.__init__ = init

    def every_subclass(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from every_subclass(sub)

    for cls in list(every_subclass(nn.Module)):  # classes imported before the script
        lighten(cls)
    had_hook = "__init_subclass__" in vars(nn.Module)
    previous = vars(nn.Module).get("__init_subclass__")

    def on_subclass(cls, **kwargs):  # classes the script (or its imports) defines
        super(nn.Module, cls).__init_subclass__(**kwargs)
        lighten(cls)

    nn.Module.__init_subclass__ = classmethod(on_subclass)
    try:
        yield
    finally:
        if had_hook:
            nn.Module.__init_subclass__ = previous
        else:
            del nn.Module.__init_subclass__
        for cls, original in originals.items():
            cls.__init__ = original


def extrapolate(values: dict[int, int], layers: int) -> tuple[int | None, str]:
    """The value at ``layers`` from the values at the cuts (keep -> value), and why not
    where they are not on one line (every layer's bytes the same)."""
    keeps = sorted(values)
    steps = [values[b] - values[a] for a, b in zip(keeps, keeps[1:])]
    widths = [b - a for a, b in zip(keeps, keeps[1:])]
    per_layer = [step / width for step, width in zip(steps, widths)]
    if any(abs(p - per_layer[-1]) > LINE_TOLERANCE_BYTES for p in per_layer):
        return None, ("the peaks at " + ", ".join(f"{k} layers" for k in keeps) +
                      " grow by " + ", ".join(f"{p:,.0f}" for p in per_layer) +
                      " bytes per layer: not one line")
    last = keeps[-1]
    return int(round(values[last] + (layers - last) * per_layer[-1])), ""


#: how far per-layer growth may differ between cuts and still be one line: the caching
#: allocator rounds blocks to 512 bytes
LINE_TOLERANCE_BYTES = 512
