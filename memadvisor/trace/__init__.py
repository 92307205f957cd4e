"""The trace format (the contract) and pure helpers over it. Imports no torch."""
from .io import Trace, TraceError, read_meta, read_trace, write_trace, events_table
from .schema import (
    CATEGORIES, COLUMN_NAMES, FORMAT_VERSION, PHASES, TraceMeta, shape_from_str, shape_to_str,
)

__all__ = [
    "Trace", "TraceError", "read_meta", "read_trace", "write_trace", "events_table",
    "CATEGORIES", "COLUMN_NAMES", "FORMAT_VERSION", "PHASES", "TraceMeta",
    "shape_from_str", "shape_to_str",
]
