"""Values, not only types: what a trace must hold for every reader to work on it.

A file can be a well-formed Parquet file with the right columns and still be nonsense a
reader would trip over (negative sizes, unknown actions, events out of order, a step list
of strings, metadata nested a thousand deep).  Each check returns a short description of the
first problem found, or None; ``io`` turns it into one ``TraceError`` line.
"""
from __future__ import annotations

from dataclasses import fields
from typing import Any

import numpy as np
import pandas as pd

from . import schema

_MAX_DEPTH = 32
_LIST_OF_DICTS = ("optimizers", "modules", "steps", "op_stats")
_DICTS = ("batch", "autocast", "allocator", "profiler_overhead", "probes", "extra")
_INTS = ("world_size", "rank", "steps_requested", "steps_completed", "parameter_count",
         "parameter_bytes", "buffer_bytes", "trainable_parameter_count")
_STRINGS = ("script", "cwd", "torch_version", "python_version", "hostname", "device",
            "device_name", "status", "error", "step_detection")
#: per step entry: keys readers use, and the types they accept
_STEP_FIELDS = {"index": (int,), "start_ns": (int,), "end_ns": (int,),
                "duration_s": (int, float, type(None)), "peak_bytes": (int,),
                "cuda_max_allocated_bytes": (int, type(None)),
                "cuda_max_reserved_bytes": (int, type(None))}


def meta_problem(data: dict[str, Any]) -> str | None:
    depth = _depth(data)
    if depth > _MAX_DEPTH:
        return f"nested {depth} deep"
    known = {f.name for f in fields(schema.TraceMeta)}
    for name in _STRINGS:
        if name in data and not isinstance(data[name], str):
            return f"{name} is {type(data[name]).__name__}, not text"
    for name in _INTS:
        if name in data and not _is_int(data[name]):
            return f"{name} is {data[name]!r}, not an integer"
        if name in data and data[name] < 0:
            return f"{name} is negative"
    if "argv" in data and not (isinstance(data["argv"], list)
                               and all(isinstance(a, str) for a in data["argv"])):
        return "argv is not a list of text"
    for name in _DICTS:
        if name in data and not isinstance(data[name], dict):
            return f"{name} is {type(data[name]).__name__}, not an object"
    for name in _LIST_OF_DICTS:
        if name in data and not (isinstance(data[name], list)
                                 and all(isinstance(e, dict) for e in data[name])):
            return f"{name} is not a list of objects"
    for step in data.get("steps", []):
        if "index" not in step:
            return "a step has no index"
        for key, kinds in _STEP_FIELDS.items():
            if key in step and (not isinstance(step[key], kinds) or isinstance(step[key], bool)):
                return f"a step's {key} is {step[key]!r}"
    for module in data.get("modules", []):
        if not isinstance(module.get("path", ""), str):
            return "a module's path is not text"
    unknown = set(data) - known
    return None if all(isinstance(k, str) for k in unknown) else "a non-text key"


def events_problem(events: pd.DataFrame) -> str | None:
    if not len(events):
        return None
    actions = {str(a) for a in events["action"].unique()}  # categorical: no per-row strings
    if not actions <= set(schema.ACTIONS):
        return f"unknown action {sorted(actions - set(schema.ACTIONS))[0]!r}"
    for name in ("size_bytes", "block_bytes"):
        column = events[name].to_numpy()
        if column.dtype.kind == "u" and len(column) and column.max() > np.iinfo(np.int64).max:
            return f"{name} beyond 2**63"
        if (column < 0).any():
            return f"negative {name}"
    if events[["seq", "size_bytes", "step", "storage_id"]].isna().to_numpy().any():
        return "missing values"
    seq = events["seq"].to_numpy()
    if len(seq) > 1 and (np.diff(seq) <= 0).any():
        return "events out of order (seq must increase)"
    steps = events["step"].to_numpy()
    if len(steps) > 1 and (np.diff(steps) < 0).any():
        return "steps go backwards"
    return None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _depth(value, level: int = 0) -> int:
    """How deep containers nest (stops counting past the limit: no deep recursion)."""
    if level > _MAX_DEPTH:
        return level
    if isinstance(value, dict):
        return max([_depth(v, level + 1) for v in value.values()], default=level + 1)
    if isinstance(value, list):
        return max([_depth(v, level + 1) for v in value], default=level + 1)
    return level
