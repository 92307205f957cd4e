"""Libraries that take another path when they see a fake tensor: shown the real run's.

Some libraries treat a ``FakeTensor`` as a sign of tracing (``torch.compile``, export) and
then skip what a traced graph cannot do -- reading a tensor's values -- taking a path the
real run never takes.  transformers' attention masks (``masking_utils``, transformers
4.5x-5.x) ask ``is_tracing(padding_mask)``, true for a fake tensor through
``utils.import_utils.is_fake_tensor``, and then always build the 4-D causal mask; a real
run whose batch has no padding skips it (``_ignore_causal_mask_sdpa``: SDPA's
``is_causal`` instead).  zoo/hf_trainer_gpt2: two 32 KiB ``where`` results per step the
real run never makes, +2.0..+2.7% over it.

Under fake execution the run is not tracing: ``is_fake_tensor`` answers False for this
run's fake tensors, and the library reads the values as in a real run -- the profiled
run's value at that line when a verification has one (``recorded_sizes.RecordedReads``),
else the placeholder (True: no padding).  The module is patched when the script imports
it (a finder on ``sys.meta_path``), or at once if it already has: a script that never
imports transformers pays nothing.
"""
from __future__ import annotations

import importlib.abc
import sys

from .patching import Patches

#: module -> function name -> makes the replacement from (original, is_ours)
_RULES = {
    "transformers.utils.import_utils": {
        "is_fake_tensor": lambda original, ours: (
            lambda x: False if ours(x) else original(x)),
    },
}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Patches a module of ``_RULES`` right after its code ran."""

    def __init__(self, patch):
        self._patch = patch
        self._busy = set()

    def find_spec(self, name, path=None, target=None):
        if name not in _RULES or name in self._busy:
            return None
        self._busy.add(name)
        try:
            from importlib.util import find_spec
            spec = find_spec(name)
        finally:
            self._busy.discard(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        loader, patch = spec.loader, self._patch

        class Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                patch(module)

        spec.loader = Loader()
        return spec


def install(mode) -> Patches:
    """Patch the libraries' checks for the length of a fake execution under ``mode``."""
    patches = Patches()

    def ours(value) -> bool:
        return getattr(value, "fake_mode", None) is mode

    def patch(module) -> None:
        for name, make in _RULES.get(module.__name__, {}).items():
            original = getattr(module, name, None)
            if callable(original):
                patches.set(module, name, make(original, ours))

    for name in _RULES:
        if name in sys.modules:
            patch(sys.modules[name])
    finder = _AfterImport(patch)
    patches.append(sys.meta_path, finder)  # removed again on undo
    sys.meta_path.remove(finder)
    sys.meta_path.insert(0, finder)  # ahead of the finders that would load the module
    return patches
