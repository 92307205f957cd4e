"""Values, not only types: what a trace must hold for every reader to work on it.

A file can be a well-formed Parquet file with the right columns and still be nonsense a
reader would trip over (negative sizes, unknown actions, events out of order, a step list
of strings, metadata nested a thousand deep).  Each check returns a short description of the
first problem found, or None; ``io`` turns it into one ``TraceError`` line.
"""
from __future__ import annotations

import math
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


# -- what readers index inside the nested metadata: a small spec language ----------------
# A spec is a callable value -> problem (str) or None.  Objects accept unknown keys (a
# newer writer's extras); a known key must hold what readers expect.

def _kind(ok, name: str):
    return lambda value: None if ok(value) else f"is {_short(value)}, not {name}"


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


COUNT = _kind(lambda v: _whole(v) and v >= 0, "a count")  #: bytes, counts: >= 0
INTEGER = _kind(_whole, "an integer")  #: positions that may be -1
NUMBER = _kind(lambda v: (_whole(v) or isinstance(v, float)) and math.isfinite(v) and v >= 0,
               "a number >= 0")
TEXT = _kind(lambda v: isinstance(v, str), "text")
FLAG = _kind(lambda v: isinstance(v, bool), "true/false")


def _any(value) -> None:
    return None


def maybe(spec):
    return lambda value: None if value is None else spec(value)


def either(*specs):
    def check(value):
        problems = [spec(value) for spec in specs]
        return None if None in problems else problems[0]
    return check


def list_of(spec, length: int | None = None):
    def check(value):
        if not isinstance(value, list):
            return f"is {_short(value)}, not a list"
        if length is not None and len(value) != length:
            return f"holds {len(value)} values, not {length}"
        for index, item in enumerate(value):
            problem = spec(item)
            if problem:
                return f"[{index}]{_joined(problem)}"
        return None
    return check


def row(*specs):
    """A list of fixed length whose items have one spec each ([bytes, start, end])."""
    def check(value):
        problem = list_of(_any, len(specs))(value)
        if problem:
            return problem
        for index, (spec, item) in enumerate(zip(specs, value)):
            problem = spec(item)
            if problem:
                return f"[{index}]{_joined(problem)}"
        return None
    return check


def mapping(spec, **special):
    """An object whose values all have ``spec``, but for the ``special`` keys."""
    def check(value):
        if not isinstance(value, dict):
            return f"is {_short(value)}, not an object"
        for key, item in value.items():
            problem = special.get(key, spec)(item)
            if problem:
                return f".{_key(key)}{_joined(problem)}"
        return None
    return check


def _key(key: str) -> str:
    """A user's key as the one-line message shows it: quoted when it would break the line."""
    return key if key.isprintable() and key else repr(key)


def record(required: tuple[str, ...] = (), **specs):
    def check(value):
        if not isinstance(value, dict):
            return f"is {_short(value)}, not an object"
        for key in required:
            if key not in value:
                return f"has no {key}"
        for key, spec in specs.items():
            problem = spec(value[key]) if key in value else None
            if problem:
                return f".{key}{_joined(problem)}"
        return None
    return check


def _joined(problem: str) -> str:
    return problem if problem.startswith((".", "[")) else " " + problem


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


_PROBE_DIRECTIONS = mapping(list_of(COUNT))
_NESTED = {
    "modules": list_of(record(
        ("path", "type"), path=TEXT, type=TEXT, parameter_bytes=COUNT, parameter_count=COUNT,
        buffer_bytes=COUNT, total_parameter_bytes=COUNT, total_parameter_count=COUNT,
        repeated=FLAG, root=FLAG)),
    "steps": list_of(record(
        ("index", "duration_s"), index=COUNT, start_ns=COUNT, end_ns=COUNT, duration_s=NUMBER,
        peak_bytes=COUNT, cuda_max_allocated_bytes=maybe(COUNT),
        cuda_max_reserved_bytes=maybe(COUNT))),
    "optimizers": list_of(record(
        (), **{"class": TEXT}, module=TEXT, hyperparameters=mapping(_any),
        param_groups=COUNT, parameter_count=COUNT, state_bytes=COUNT,
        state_tensors_per_parameter=NUMBER)),
    "op_stats": list_of(record((), module=TEXT, phase=TEXT, op=TEXT, calls=COUNT,
                               flops=NUMBER)),
    "batch": record((), batch_size=maybe(COUNT), shapes=list_of(list_of(COUNT)),
                    dtypes=list_of(TEXT), names=list_of(TEXT),
                    batch_dims=list_of(maybe(COUNT)), evidence=TEXT),
    "autocast": record((), enabled=FLAG, dtype=maybe(TEXT)),
    # 16-bit kernel blocks measured by the profiler (profile/probes.py)
    "probes": mapping(list_of(record(
        ("module",), module=TEXT, input_shape=list_of(COUNT), threads=COUNT,
        rows=list_of(COUNT), float32_blocks=COUNT, skipped=TEXT,
        raw_bytes=mapping(_PROBE_DIRECTIONS), bfloat16=_PROBE_DIRECTIONS,
        float16=_PROBE_DIRECTIONS,
        calls=mapping(mapping(record(
            (), raw=list_of(row(COUNT, COUNT, COUNT)), typed=list_of(row(TEXT, COUNT)),
            length=COUNT))))),
        skipped=TEXT),  # {'skipped': why}: the run ended before probing
    # an imported snapshot's allocator record (snapshot/importer.py)
    "allocator": record(
        # settings: a snapshot's allocator_settings, or a CUDA run's PYTORCH_CUDA_ALLOC_CONF
        (), source=TEXT, settings=either(mapping(_any), TEXT),
        initial_segments=list_of(record(("address", "total_size", "small"),
                                        address=COUNT, total_size=COUNT, small=_any,
                                        stream=INTEGER)),
        initial_reserved_bytes=COUNT, initial_blocks=COUNT,
        segment_events=list_of(row(INTEGER, TEXT, COUNT, COUNT, INTEGER, COUNT, COUNT)),
        peak_allocated_bytes=COUNT, peak_reserved_bytes=COUNT, segments=COUNT,
        oom_events=list_of(row(INTEGER, COUNT, COUNT)), cublas_workspace_bytes=list_of(COUNT),
        gpu_hint=TEXT, start_time_us=NUMBER),
    # the DataLoaders the script iterated (profile/data_loaders.py); None: not recorded
    "data_loaders": maybe(list_of(record(
        (), num_workers=COUNT, prefetch_factor=maybe(COUNT), pin_memory=FLAG,
        pin_memory_used=FLAG, persistent_workers=FLAG, batch_size=maybe(COUNT),
        source=TEXT, batches=COUNT, wait_s=NUMBER, batch_bytes=COUNT,
        batch_pinned_bytes=COUNT, cpu_count=COUNT, host_memory_bytes=COUNT,
        steps=list_of(record(("index",), index=COUNT, batches=COUNT, wait_s=NUMBER,
                             batch_bytes=COUNT, copy_bytes=COUNT,
                             non_blocking_copy_bytes=COUNT, pinned_copy_bytes=COUNT)),
        copies=list_of(record((), source=TEXT, device=TEXT, non_blocking=FLAG,
                              source_pinned=FLAG, from_batch=FLAG, calls=COUNT,
                              bytes=COUNT)),
        workers_memory=record((), samples=COUNT, max_rss_bytes=list_of(COUNT),
                              max_private_bytes=list_of(COUNT),
                              max_anonymous_bytes=list_of(COUNT),
                              max_total_rss_bytes=COUNT, max_total_private_bytes=COUNT,
                              max_total_anonymous_bytes=COUNT)))),
}


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
    for name, spec in _NESTED.items():
        problem = spec(data[name]) if name in data else None
        if problem:
            return f"{name}{_joined(problem)}"
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
