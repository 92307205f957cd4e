"""Which modules lie inside which module paths, by each module's own path prefixes.

Asking every region of every module (``name == path or name.startswith(path + ".")``) is
regions x modules string compares: with 760 checkpointed or FSDP blocks of ~10 modules each
that was tens of seconds of ``advise`` on a real trace.  Walking each module's prefixes
(``a``, ``a.b``, ``a.b.c``) through a dict of the paths costs modules x depth instead.
A path ``''`` contains only the module ``''`` here (the root module's own tensors), as the
string test does; callers for whom ``''`` means the whole model say so themselves.
"""
from __future__ import annotations

import numpy as np


def _prefixes(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def containing(modules: list[str], paths: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(module code, path index) for every module that is a path or inside it."""
    index: dict[str, list[int]] = {}
    for i, path in enumerate(paths):
        index.setdefault(path, []).append(i)
    codes, found = [], []
    for code, name in enumerate(modules):
        for prefix in _prefixes(name):
            for i in index.get(prefix, ()):
                codes.append(code)
                found.append(i)
    return np.asarray(codes, np.int64), np.asarray(found, np.int64)


def last_containing(modules: list[str], paths: list[str]) -> np.ndarray:
    """Per module code, the index of the last path that is it or contains it (-1: none)."""
    out = np.full(len(modules), -1, np.int64)
    codes, found = containing(modules, paths)
    np.maximum.at(out, codes, found)
    return out


def inside_any(modules: list[str], regions) -> np.ndarray:
    """Per module code: the module is one of ``regions`` or inside one; ``''`` among them
    holds every module (a checkpointed whole model)."""
    regions = list(regions)
    if "" in regions:
        return np.ones(len(modules), bool)
    out = np.zeros(len(modules), bool)
    out[containing(modules, regions)[0]] = True
    return out
