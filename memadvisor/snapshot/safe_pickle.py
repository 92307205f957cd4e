"""Loading a snapshot pickle without ever running code from it.

A pickle is a program: ``pickle.load`` on a file a user hands us could execute anything
(``os.system`` through ``__reduce__``).  A memory snapshot only ever holds plain
containers, so the unpickler below refuses every global lookup (the only way a pickle
reaches a callable) and persistent ids, and the loaded object is then walked to accept
only the types a snapshot contains.  Every failure -- not a pickle, truncated, a
forbidden global, an unexpected type, not a snapshot -- is one ``SnapshotError`` line.
"""
from __future__ import annotations

import gzip
import io
import pickle
from pathlib import Path

from ..errors import UserError

#: what ``torch.cuda.memory._snapshot()`` is made of
ALLOWED_TYPES = (dict, list, tuple, str, bytes, int, float, bool, type(None))
_GZIP_MAGIC = b"\x1f\x8b"
_MAX_DEPTH = 64


class SnapshotError(UserError):
    """A file that is not a usable snapshot; the message is one line."""


class _Refused(pickle.UnpicklingError):
    """The pickle asked for something a snapshot never holds."""


class _PlainDataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        raise _Refused(f"it asks to load {module}.{name}, which a memory snapshot never "
                       "contains")

    def persistent_load(self, pid):
        raise _Refused("it holds a persistent id, which a memory snapshot never contains")


def loads_plain(data: bytes, what: str = "data") -> object:
    """Unpickle ``data`` accepting only ``ALLOWED_TYPES``; SnapshotError otherwise."""
    try:
        value = _PlainDataUnpickler(io.BytesIO(data)).load()
    except _Refused as exc:
        raise SnapshotError(f"{what}: refused: {_first_line(exc)}") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError,
            OverflowError, MemoryError, RecursionError) as exc:
        # the C unpickler reports a cut-off or garbled stream in several ways
        raise SnapshotError(f"{what}: not a readable pickle "
                            f"({type(exc).__name__}: {_first_line(exc)})") from None
    bad = _first_foreign_type(value)
    if bad is not None:
        raise SnapshotError(f"{what}: refused: it holds a {bad}, which a memory snapshot "
                            "never contains")
    return value


def load_snapshot(path: str | Path) -> dict:
    """Read a snapshot file (plain or gzip-compressed pickle) as a checked dict."""
    path = Path(path)
    if not path.exists():
        raise SnapshotError(f"{path}: no such file")
    if path.is_dir():
        raise SnapshotError(f"{path}: is a directory, not a snapshot file")
    try:
        data = path.read_bytes()
        if data[:2] == _GZIP_MAGIC:
            data = gzip.decompress(data)
    except (OSError, EOFError) as exc:
        raise SnapshotError(f"{path}: cannot read ({_first_line(exc)})") from None
    if not data:
        raise SnapshotError(f"{path}: file is empty")
    snapshot = loads_plain(data, str(path))
    check_snapshot(snapshot, str(path))
    return snapshot


def check_snapshot(snapshot: object, what: str) -> None:
    """The structure every reader below relies on, checked once here."""
    if not isinstance(snapshot, dict) or "segments" not in snapshot:
        raise SnapshotError(f"{what}: a pickle, but not a CUDA memory snapshot "
                            "(no 'segments'; made by torch.cuda.memory._dump_snapshot?)")
    segments, traces = snapshot["segments"], snapshot.get("device_traces", [])
    if not isinstance(segments, list) or not isinstance(traces, list):
        raise SnapshotError(f"{what}: damaged snapshot ('segments'/'device_traces' are not "
                            "lists)")
    for segment in segments:
        if not isinstance(segment, dict) or not {"address", "total_size", "blocks"} <= set(
                segment) or not isinstance(segment["blocks"], list):
            raise SnapshotError(f"{what}: damaged snapshot (a segment lacks address, "
                                "total_size or blocks)")
    for trace in traces:
        if not isinstance(trace, list) or not all(
                isinstance(e, dict) and {"action", "addr", "size"} <= set(e) for e in trace):
            raise SnapshotError(f"{what}: damaged snapshot (a trace event lacks action, addr "
                                "or size)")


def _first_foreign_type(value: object) -> str | None:
    # containers are visited once: a pickle can share one list many times over (memo
    # references), which a naive walk would expand exponentially
    stack, seen = [(value, 0)], set()
    while stack:
        item, depth = stack.pop()
        if type(item) not in ALLOWED_TYPES:
            return type(item).__name__
        if depth > _MAX_DEPTH:
            return "nesting deeper than a snapshot's"
        if isinstance(item, (dict, list, tuple)):
            if id(item) in seen:
                continue
            seen.add(id(item))
        if isinstance(item, dict):
            stack.extend((k, depth + 1) for k in item.keys())
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend((v, depth + 1) for v in item)
    return None


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
