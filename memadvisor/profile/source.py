"""Find the innermost frame of *user* code on the Python stack.

"User code" is anything that is not the standard library, an installed package
(site-packages: torch, numpy, ...) or memadvisor itself.  The answer per code object is
cached, so a lookup is a short walk of dictionary hits.
"""
from __future__ import annotations

import os
import sys
import sysconfig

_MEMADVISOR_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _library_roots() -> tuple[str, ...]:
    roots = {_MEMADVISOR_DIR}
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            roots.add(os.path.realpath(path))
    for path in sys.path:
        if path and ("site-packages" in path or "dist-packages" in path):
            roots.add(os.path.realpath(path))
    return tuple(sorted(roots))


class SourceLocator:
    """``locate()`` -> (file, line, function) of the innermost user frame, or ('', 0, '')."""

    def __init__(self, extra_user_files: tuple[str, ...] = ()):
        self._roots = _library_roots()
        self._is_user: dict[object, bool] = {}
        # the profiled script counts as user code even if it sits in an odd place
        self._forced = {os.path.realpath(f) for f in extra_user_files}

    def _classify(self, code) -> bool:
        filename = code.co_filename
        if filename.startswith("<"):
            # <string>, <frozen ...>, generated code: not a line the user can open
            return False
        real = os.path.realpath(filename)
        if real in self._forced:
            return True
        return not any(real.startswith(root + os.sep) or real == root for root in self._roots)

    def locate(self, skip: int = 1) -> tuple[str, int, str]:
        frame = sys._getframe(skip)
        cache = self._is_user
        while frame is not None:
            code = frame.f_code
            is_user = cache.get(code)
            if is_user is None:
                is_user = cache[code] = self._classify(code)
            if is_user:
                return code.co_filename, frame.f_lineno, code.co_name
            frame = frame.f_back
        return "", 0, ""
