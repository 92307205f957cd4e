"""``torch.nn.init`` on fake tensors: nothing to fill.

Initialisers only write values, and a fake tensor has none.  One of them cannot even end
on fake tensors: torch 2.13's ``trunc_normal_`` redraws out-of-range samples in
``while True: if not mask.any(): break``, and ``mask.any()`` answers the placeholder True
forever (placeholders.py), so every model that initialises with it (GPT-style LMs, ViTs)
would hang while being built.  On a meta tensor torch itself returns at once
(``if tensor.is_meta: return tensor``); fake tensors get the same answer here.

The helpers every public initialiser goes through (``_no_grad_uniform_`` ...) are patched,
so ``from torch.nn.init import trunc_normal_`` done before fake execution began is covered
too: the public functions look the helpers up at call time.  Real tensors are initialised
as before.

What this leaves out: the temporaries ``trunc_normal_`` makes while redrawing (a mask and
a sample tensor the size of the parameter, freed at once).  On a GPU they exist only when
a model is initialised on the device, before training; they never reach a step's peak.
"""
from __future__ import annotations

import torch.nn.init as init
from torch._subclasses.fake_tensor import FakeTensor

from .patching import Patches

#: the value-writing helpers of torch.nn.init (torch 2.x); the first argument is the tensor
_HELPERS = ("_no_grad_uniform_", "_no_grad_normal_", "_no_grad_trunc_normal_",
            "_no_grad_fill_", "_no_grad_zero_")
#: public initialisers that write values without going through a helper
_PUBLIC = ("eye_", "dirac_", "orthogonal_", "sparse_")


def _skipping_fake(original):
    def initialiser(tensor, *args, **kwargs):
        if isinstance(tensor, FakeTensor):
            return tensor
        return original(tensor, *args, **kwargs)
    initialiser.__wrapped__ = original
    return initialiser


def install() -> Patches:
    patches = Patches()
    for name in (*_HELPERS, *_PUBLIC):
        original = getattr(init, name, None)
        if original is not None:
            patches.set(init, name, _skipping_fake(original))
    return patches
