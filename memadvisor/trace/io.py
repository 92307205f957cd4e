"""Reading and writing trace files (Parquet through pyarrow).

Every way a file can be wrong -- missing, not Parquet, truncated, not a memadvisor trace,
written by a newer memadvisor, missing columns -- becomes one ``TraceError`` with a
one-line message the CLI prints as is.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import TraceError  # noqa: F401  (raised here, caught by the CLI)
from ..output_files import write_output
from .validate import events_problem, meta_problem
from .schema import (
    COLUMNS, COLUMN_NAMES, FORMAT_NAME, FORMAT_VERSION, METADATA_KEY, OPTIONAL_LIST_COLUMNS,
    OPTIONAL_ZERO_COLUMNS, TraceMeta,
)

_ID_LIST = pa.list_(pa.int64())


@dataclass
class Trace:
    """A loaded trace: ``events`` (one row per event, ordered by ``seq``) and ``meta``."""

    events: pd.DataFrame
    meta: TraceMeta
    path: str = ""

    def __len__(self) -> int:
        return len(self.events)


def _arrow_array(name: str, values: Sequence[Any]) -> pa.Array:
    kind = COLUMNS[name][0]
    if kind == "dict":
        return pa.array(values, type=pa.string()).dictionary_encode()
    if kind == "list":
        return _id_lists(values)
    return pa.array(values, type=getattr(pa, kind)())


def _id_lists(values) -> pa.Array:
    """A list<int64> column from a sequence of id lists, an Arrow array or an
    Arrow-backed pandas column (kept as it is: no Python object per row)."""
    if isinstance(values, pd.Series):
        values = values.array
    if isinstance(values, (pa.Array, pa.ChunkedArray)) or hasattr(values, "__arrow_array__"):
        array = values if isinstance(values, (pa.Array, pa.ChunkedArray)) else pa.array(values)
        if isinstance(array, pa.ChunkedArray):
            array = array.combine_chunks()
        return array.cast(_ID_LIST)
    return pa.array([list(v) if v is not None else [] for v in values], type=_ID_LIST)


def empty_id_lists(rows: int) -> pa.Array:
    """``rows`` empty lists (a writer that records no data flow)."""
    return pa.ListArray.from_arrays(pa.array(np.zeros(rows + 1, np.int32)),
                                    pa.array([], pa.int64()))


def id_lists(events: pd.DataFrame, column: str = "input_ids") -> tuple[np.ndarray, np.ndarray]:
    """(offsets, values) of an id-list column: row ``i``'s ids are
    ``values[offsets[i]:offsets[i + 1]]``.  Empty lists for a frame without the column."""
    if column not in events:
        return np.zeros(len(events) + 1, np.int64), np.zeros(0, np.int64)
    array = _id_lists(events[column])
    offsets = np.asarray(array.offsets, np.int64)
    values = np.asarray(array.values, np.int64)
    return offsets - offsets[0], values[offsets[0]:offsets[-1]]


def events_table(columns: Mapping[str, Sequence[Any]]) -> pa.Table:
    """Build the events table from plain per-column sequences (all columns required but
    the allocator's, ``OPTIONAL_ZERO_COLUMNS``, which default to 0)."""
    missing = [c for c in COLUMN_NAMES if c not in columns and c not in OPTIONAL_ZERO_COLUMNS
               and c not in OPTIONAL_LIST_COLUMNS]
    if missing:
        raise ValueError(f"event columns missing: {', '.join(missing)}")
    rows = len(columns["seq"])

    def values(name):
        given = columns.get(name)
        if name in OPTIONAL_ZERO_COLUMNS and (given is None or (rows and not len(given))):
            return np.zeros(rows, dtype=np.int64)
        if name in OPTIONAL_LIST_COLUMNS and (given is None or (rows and not len(given))):
            return empty_id_lists(rows)
        return given
    return pa.table({name: _arrow_array(name, values(name)) for name in COLUMN_NAMES})


def _table_from_frame(events: pd.DataFrame) -> pa.Table:
    arrays = {}
    for name in COLUMN_NAMES:
        if name not in events and name in OPTIONAL_ZERO_COLUMNS:
            arrays[name] = pa.array(np.zeros(len(events), dtype=np.int64))
            continue
        if name not in events and name in OPTIONAL_LIST_COLUMNS:
            arrays[name] = empty_id_lists(len(events))
            continue
        column = events[name]
        if COLUMNS[name][0] == "list":
            arrays[name] = _id_lists(column)
        elif COLUMNS[name][0] == "dict":
            arrays[name] = pa.array(column.astype(str), type=pa.string()).dictionary_encode()
        else:
            arrays[name] = pa.array(column.to_numpy(), type=getattr(pa, COLUMNS[name][0])())
    return pa.table(arrays)


def write_trace(path: str | os.PathLike, events: pa.Table | pd.DataFrame,
                meta: TraceMeta) -> Path:
    """Write atomically: a crash while writing never leaves a half file under ``path``."""
    path = Path(path)
    table = events if isinstance(events, pa.Table) else _table_from_frame(events)
    meta_json = json.dumps(meta.to_dict(), default=str).encode()
    table = table.replace_schema_metadata({METADATA_KEY: meta_json})
    # atomic for a regular file; a symlink or device node is written through, never replaced
    return write_output(path, lambda where: pq.write_table(table, where, compression="zstd"))


def read_meta(path: str | os.PathLike) -> TraceMeta:
    """Read only the metadata (cheap: the footer)."""
    path = Path(path)
    _check_exists(path)
    try:
        schema = pq.read_schema(path)
    except (pa.ArrowException, OSError) as exc:
        raise TraceError(f"{path}: not a readable trace file ({_first_line(exc)})") from None
    return _meta_from_schema(path, schema)


def read_trace(path: str | os.PathLike) -> Trace:
    path = Path(path)
    meta = read_meta(path)
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise TraceError(f"{path}: trace file is damaged ({_first_line(exc)})") from None
    for name in OPTIONAL_ZERO_COLUMNS:
        # format 1 had no allocator columns: nothing was known about blocks
        if name not in table.column_names:
            table = table.append_column(name, pa.array(np.zeros(len(table), dtype=np.int64)))
    for name in OPTIONAL_LIST_COLUMNS:
        # formats 1 and 2 recorded no data flow
        if name not in table.column_names:
            table = table.append_column(name, empty_id_lists(len(table)))
    missing = [c for c in COLUMN_NAMES if c not in table.column_names]
    if missing:
        raise TraceError(f"{path}: trace lacks columns {', '.join(missing)}")
    table = table.select(list(COLUMN_NAMES))
    for name in COLUMN_NAMES:
        if not _type_matches(COLUMNS[name][0], table.schema.field(name).type):
            raise TraceError(f"{path}: column {name} has type {table.schema.field(name).type}, "
                             f"expected {COLUMNS[name][0]}")
    # one block per column, each Arrow buffer released as its column is converted: no
    # second copy of the table while the DataFrame is made, and no consolidation copy
    # id lists stay Arrow-backed (offsets and values, no Python list per row)
    events = table.to_pandas(split_blocks=True, self_destruct=True, types_mapper=_arrow_lists)
    del table
    problem = events_problem(events)
    if problem:
        raise TraceError(f"{path}: trace events are damaged ({problem})")
    return Trace(events=events, meta=meta, path=str(path))


def _arrow_lists(arrow_type: pa.DataType):
    return pd.ArrowDtype(arrow_type) if pa.types.is_list(arrow_type) else None


def _type_matches(kind: str, arrow_type: pa.DataType) -> bool:
    if kind == "list":
        return pa.types.is_list(arrow_type) and pa.types.is_integer(arrow_type.value_type)
    if kind == "dict":
        return pa.types.is_dictionary(arrow_type) or pa.types.is_string(arrow_type) \
            or pa.types.is_large_string(arrow_type)
    return pa.types.is_integer(arrow_type)


def _check_exists(path: Path) -> None:
    if not path.exists():
        raise TraceError(f"{path}: no such trace file")
    if path.is_dir():
        raise TraceError(f"{path}: is a directory, not a trace file")
    if path.stat().st_size == 0:
        raise TraceError(f"{path}: trace file is empty")


def _meta_from_schema(path: Path, schema: pa.Schema) -> TraceMeta:
    raw = (schema.metadata or {}).get(METADATA_KEY)
    if raw is None:
        raise TraceError(f"{path}: a Parquet file, but not a memadvisor trace")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        raise TraceError(f"{path}: trace metadata is damaged") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        raise TraceError(f"{path}: not a memadvisor trace")
    version = data.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise TraceError(f"{path}: trace has no valid format version ({version!r})")
    if version > FORMAT_VERSION:
        raise TraceError(
            f"{path}: trace format version {version} is newer than this memadvisor reads "
            f"({FORMAT_VERSION}); upgrade memadvisor")
    problem = meta_problem(data)
    if problem:
        raise TraceError(f"{path}: trace metadata is damaged ({problem})")
    return TraceMeta.from_dict(_upgrade(data))


def _upgrade(data: dict[str, Any]) -> dict[str, Any]:
    """Adapt metadata of older format versions to the current one (formats 2 and 3 only
    added event columns, filled in ``read_trace``)."""
    return {**data, "format_version": FORMAT_VERSION}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
