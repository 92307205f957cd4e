"""The native engine: per-op bookkeeping in C++ (``cuda_hooks/op_tracker.cpp``).

The dispatch engine (``dispatch.py``) runs Python for every aten op, which costs a
profiled step ~10% on a CPU-bound model; torch.profiler pays a few microseconds per op in
C++.  This engine moves what happens per op and per allocation into the op tracker
library (the CPU allocator hook plus a RecordFunction callback) and keeps in Python only
what happens per module call, per saved tensor and per step (module paths, phases,
categories, steps): the same ``ProfileSession`` hooks as before, talking to a
:class:`NativeRecorder` instead of the Python :class:`~.recorder.EventRecorder`.

The trace is the same: one row per allocation and free of a storage (the allocator's
block), charged to the aten op a Python dispatch mode would see, with the dtype and shape
of the tensor that op returned in it (raw ``bytes`` for kernel scratch), the module and
phase at that moment, and the user's source line read from the Python stack.
``tests/profile/test_native_engine.py`` holds the two engines' traces of the bundled
examples side by side.

CPU only: the library wraps c10's CPU allocator.  A session on a machine with a GPU uses
the dispatch engine (``engine="auto"``), which follows CUDA storages too.
"""
from __future__ import annotations

import ctypes
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from ..trace import schema
from ..trace.io import events_table
from . import native
from .native import NativeHookUnavailable
from .recorder import CATEGORY_PRIORITY

SOURCE_NAME = "op_tracker.cpp"
API_VERSION = 2  #: 2: data flow (input_ids)

PHASE_CODES = {schema.OTHER_PHASE: 0, schema.FORWARD: 1, schema.BACKWARD: 2,
               schema.OPTIMIZER: 3}
PHASE_NAMES = {code: name for name, code in PHASE_CODES.items()}
#: the C++ Category enum is the priority order
CATEGORY_NAMES = sorted(CATEGORY_PRIORITY, key=CATEGORY_PRIORITY.get)
CATEGORY_CODES = {name: code for code, name in enumerate(CATEGORY_NAMES)}
_UNMARKED = 127

EVENT_DTYPE = np.dtype([
    ("seq", np.int64), ("time_ns", np.int64), ("sid", np.int64), ("size", np.int64),
    ("kind", np.int32), ("op", np.int32), ("module", np.int32), ("phase", np.int32),
    ("source", np.int32), ("dtype", np.int32), ("shape", np.int64),
])
assert EVENT_DTYPE.itemsize == 64

# c10::toString(ScalarType) -> torch's dtype name
_C10_DTYPES = {
    "Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16",
    "Long": "int64", "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8",
    "Bool": "bool", "ComplexFloat": "complex64", "ComplexDouble": "complex128",
    "ComplexHalf": "complex32", "UInt16": "uint16", "UInt32": "uint32", "UInt64": "uint64",
}

_P = ctypes.c_void_p
_I64, _I32, _U64 = ctypes.c_int64, ctypes.c_int32, ctypes.c_uint64
_SIGNATURES = {
    "ma_t_api_version": (ctypes.c_int, []),
    "ma_t_start": (ctypes.c_int, [_I64, ctypes.py_object]),
    "ma_t_stop": (None, []),
    "ma_t_reset": (None, []),
    "ma_t_set_flop_op": (None, [ctypes.c_char_p]),
    "ma_t_set_module": (None, [_I32]),
    "ma_t_set_phase": (None, [_I32]),
    "ma_t_phase": (_I32, []),
    "ma_t_set_have_roots": (None, [ctypes.c_int]),
    "ma_t_set_link_backward": (None, [ctypes.c_int]),
    "ma_t_take_forward_begin": (_I64, []),
    "ma_t_set_op_override": (None, [ctypes.c_char_p]),
    "ma_t_next_seq": (_I64, []),
    "ma_t_live_bytes": (_I64, []),
    "ma_t_peak_bytes": (_I64, []),
    "ma_t_lookup": (_I64, [_U64]),
    "ma_t_size_of": (_I64, [_U64]),
    "ma_t_alloc_phase": (_I32, [_U64]),
    "ma_t_mark": (_I32, [_U64, _I32]),
    "ma_t_mark_sid": (None, [_I64, _I32]),
    "ma_t_sid_category": (_I32, [_I64]),
    "ma_t_category": (_I32, [_U64]),
    "ma_t_set_owner": (None, [_U64, _I32]),
    "ma_t_mark_many": (_I64, [_P, _P, _P, _I64, _P]),
    "ma_t_external_alloc": (_I64, [_U64, _I64, _I32, _I32, _P, ctypes.c_char_p]),
    "ma_t_external_free": (None, [_U64, _I64]),
    "ma_t_event_count": (_I64, []),
    "ma_t_copy_events": (None, [_P, _I64]),
    "ma_t_shape_count": (_I64, []),
    "ma_t_copy_shapes": (None, [_P, _I64]),
    "ma_t_input_pool_count": (_I64, []),
    "ma_t_copy_input_pool": (None, [_P, _I64]),
    "ma_t_input_ref_count": (_I64, []),
    "ma_t_copy_input_refs": (None, [_P, _I64]),
    "ma_t_mark_count": (_I64, []),
    "ma_t_copy_marks": (_I64, [_P, _P, _I64]),
    "ma_t_owner_count": (_I64, []),
    "ma_t_copy_owners": (_I64, [_P, _P, _I64]),
    "ma_t_op_count": (_I32, []),
    "ma_t_op_name": (_I32, [_I32, ctypes.c_char_p, _I32]),
    "ma_t_dtype_name": (_I32, [_I32, ctypes.c_char_p, _I32]),
    "ma_t_sources_into": (ctypes.c_int, [ctypes.py_object]),
    "ma_t_call_count": (_I64, []),
    "ma_t_copy_calls": (_I64, [_P, _P, _I64]),
    "ma_t_flop_call_count": (_I64, []),
    "ma_t_copy_flop_calls": (None, [_P, _I64]),
    "ma_t_flop_args_count": (_I64, []),
    "ma_t_flop_args": (_I64, [_I64, _P, _I64]),
}

_lock = threading.Lock()
_library: "ctypes.PyDLL | None" = None
_library_path: Path | None = None


def _open_tracker(path: Path) -> tuple[Path, ctypes.PyDLL]:
    try:
        # PyDLL: calls keep the GIL (cheaper than releasing it, and the functions
        # that take Python objects need it)
        lib = ctypes.PyDLL(str(path), mode=ctypes.RTLD_LOCAL)
        for name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
    except (OSError, AttributeError) as exc:
        raise NativeHookUnavailable(f"cannot load {path.name}: {exc}") from None
    if lib.ma_t_api_version() != API_VERSION:
        raise NativeHookUnavailable(f"{path.name} has an unexpected API version")
    return path, lib


def load_library() -> ctypes.PyDLL:
    """Build (first use: ~10 s, then cached) and load the op tracker; the same library
    every call.  Raises NativeHookUnavailable(reason)."""
    global _library, _library_path
    with _lock:
        if _library is not None:
            return _library
        import os
        if os.environ.get("MEMADVISOR_NO_NATIVE"):
            raise NativeHookUnavailable("disabled by MEMADVISOR_NO_NATIVE")
        from .. import native_build
        path, lib = native_build.open_or_rebuild(
            lambda force: native.build(source_name=SOURCE_NAME, force=force), _open_tracker,
            NativeHookUnavailable)
        _library, _library_path = lib, path
        return lib


def available() -> tuple[bool, str]:
    """Whether the native engine can run here, and why not."""
    try:
        load_library()
    except NativeHookUnavailable as exc:
        return False, exc.reason
    except Exception as exc:  # a probe never takes the profiler down
        return False, " ".join(f"{type(exc).__name__}: {exc}".split())
    return True, f"loaded {_library_path}"


def _flop_formulas() -> dict[str, Any]:
    """torch's FLOP formulas by op name ('aten::mm'), as the dispatch engine uses them."""
    try:
        from torch.utils.flop_counter import flop_registry
    except ImportError:  # pragma: no cover - very old torch
        return {}
    formulas = {}
    for key, formula in flop_registry.items():
        packet = getattr(key, "_overloadpacket", key)
        name = getattr(packet, "_qualified_op_name", None)
        if name:
            formulas[name] = formula
    return formulas


def _decode(values: list[int], at: int) -> tuple[Any, int]:
    """One argument of op_tracker.cpp's encoding: tensors become their shape."""
    tag = values[at]
    if tag == 0:
        return None, at + 1
    if tag == 1:
        ndim = values[at + 1]
        return tuple(values[at + 2: at + 2 + ndim]), at + 2 + ndim
    if tag == 2:
        return values[at + 1], at + 2
    if tag == 3:
        return float(np.array([values[at + 1]], np.int64).view(np.float64)[0]), at + 2
    if tag == 4:
        return bool(values[at + 1]), at + 2
    if tag in (5, 6):
        n = values[at + 1]
        items = values[at + 2: at + 2 + n]
        return ([bool(v) for v in items] if tag == 6 else list(items)), at + 2 + n
    if tag == 7:
        n, at = values[at + 1], at + 2
        items = []
        for _ in range(n):
            item, at = _decode(values, at)
            items.append(item)
        return items, at
    return None, at + 1  # something the formulas do not read


def decode_args(values: list[int]) -> tuple[list, Any]:
    """(input arguments, output value) of one recorded call."""
    inputs, outputs, at, target = [], [], 0, None
    target = inputs
    while at < len(values):
        if values[at] == -1:
            target, at = outputs, at + 1
            continue
        value, at = _decode(values, at)
        target.append(value)
    return inputs, (outputs[0] if len(outputs) == 1 else tuple(outputs))


class NativeRecorder:
    """The EventRecorder interface over the op tracker (storages are keyed by their data
    pointer, which is the allocator's block address)."""

    def __init__(self, lib: ctypes.PyDLL, classify, clock=time.monotonic_ns):
        self._lib = lib
        self._clock = clock
        self.start_ns = clock()
        self._modules: dict[str, int] = {"": 0}
        self._module_names: list[str] = [""]
        self._module = ""
        self._classify = classify
        #: external storages: sid -> (device, dtype, shape); their weakrefs by sid
        self._external: dict[int, tuple[str, str, str]] = {}
        self._refs: dict[int, weakref.ref] = {}
        self._formulas = _flop_formulas()
        self.enabled = True
        self._started = False

    # --- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        lib = self._lib
        lib.ma_t_reset()
        for name in self._formulas:
            lib.ma_t_set_flop_op(name.encode())
        rc = lib.ma_t_start(self.start_ns, self._classify)
        if rc != 0:
            raise NativeHookUnavailable(f"starting the op tracker failed (code {rc})")
        self._started = True

    def stop(self) -> None:
        """No more events: frees after this (interpreter teardown) are not part of the run."""
        if self._started:
            self._lib.ma_t_stop()
        self.enabled = False

    # --- where we are ------------------------------------------------------------------
    @property
    def phase(self) -> str:
        return PHASE_NAMES[self._lib.ma_t_phase()]

    @phase.setter
    def phase(self, name: str) -> None:
        self._lib.ma_t_set_phase(PHASE_CODES[name])

    @property
    def module(self) -> str:
        return self._module

    @module.setter
    def module(self, name: str) -> None:
        self._module = name
        self._lib.ma_t_set_module(self._module_id(name))

    def _module_id(self, name: str) -> int:
        code = self._modules.get(name)
        if code is None:
            code = self._modules[name] = len(self._module_names)
            self._module_names.append(name)
        return code

    def set_have_roots(self) -> None:
        self._lib.ma_t_set_have_roots(1)

    def take_forward_begin(self) -> int:
        return self._lib.ma_t_take_forward_begin()

    def op_override(self, name: str | None) -> None:
        self._lib.ma_t_set_op_override(None if name is None else name.encode())

    @property
    def live_bytes(self) -> int:
        return self._lib.ma_t_live_bytes()

    @property
    def peak_bytes(self) -> int:
        return self._lib.ma_t_peak_bytes()

    # --- storages ----------------------------------------------------------------------
    def lookup(self, storage) -> int | None:
        ptr = storage.data_ptr()
        sid = self._lib.ma_t_lookup(ptr) if ptr else -1
        return None if sid < 0 else sid

    def size_of(self, storage) -> int:
        ptr = storage.data_ptr()
        return self._lib.ma_t_size_of(ptr) if ptr else -1

    def created_phase(self, storage) -> str | None:
        ptr = storage.data_ptr()
        code = self._lib.ma_t_alloc_phase(ptr) if ptr else -1
        return None if code < 0 else PHASE_NAMES[code]

    def alloc(self, storage, device: str, dtype: str, shape: str, op: str,
              source=None, size_bytes: int | None = None) -> int | None:
        """Log a storage the allocator hook never saw (the source line is read from the
        Python stack natively); its free is logged when its Python object dies."""
        ptr = storage.data_ptr()
        size = storage.nbytes() if size_bytes is None else size_bytes
        if not ptr or not size:
            return None
        sid = self._lib.ma_t_external_alloc(ptr, size, -1, -1, None, op.encode())
        if sid in self._refs:
            return sid
        self._external[sid] = (device, dtype, shape)
        lib = self._lib
        self._refs[sid] = weakref.ref(
            storage, lambda _ref, ptr=ptr, sid=sid: (lib.ma_t_external_free(ptr, sid),
                                                     self._refs.pop(sid, None)))
        return sid

    def external_free(self, ptr: int, sid: int) -> None:
        self._lib.ma_t_external_free(ptr, sid)
        self._refs.pop(sid, None)

    def is_external(self, sid: int) -> bool:
        return sid in self._external

    # --- categories --------------------------------------------------------------------
    def mark(self, storage, category: str) -> bool:
        """Mark the storage; False when it was never logged (nothing marked)."""
        ptr = storage.data_ptr()
        return bool(ptr) and bool(self._lib.ma_t_mark(ptr, CATEGORY_CODES[category]))

    def mark_many(self, items: list) -> list:
        """Mark (tensor, category, owner path or None) triples in one call; returns the
        triples whose storage nobody logged yet (the caller registers them)."""
        n = len(items)
        if not n:
            return []
        ptrs = np.fromiter((t.untyped_storage().data_ptr() for t, _, _ in items), np.uint64, n)
        categories = np.fromiter((CATEGORY_CODES[c] for _, c, _ in items), np.int32, n)
        owners = np.fromiter((-1 if o is None else self._module_id(o) for _, _, o in items),
                             np.int32, n)
        unknown = np.zeros(n, np.uint8)
        missing = self._lib.ma_t_mark_many(ptrs.ctypes.data, categories.ctypes.data,
                                           owners.ctypes.data, n, unknown.ctypes.data)
        if not missing:
            return []
        return [item for item, flag in zip(items, unknown.tolist()) if flag]

    def mark_sid(self, sid: int, category: str) -> None:
        self._lib.ma_t_mark_sid(sid, CATEGORY_CODES[category])

    def category_of_sid(self, sid: int) -> str | None:
        code = self._lib.ma_t_sid_category(sid)
        return None if code < 0 else CATEGORY_NAMES[code]

    def set_owner(self, storage, module_path: str) -> None:
        ptr = storage.data_ptr()
        if ptr:
            self._lib.ma_t_set_owner(ptr, self._module_id(module_path))

    def category_of(self, storage) -> str | None:
        ptr = storage.data_ptr()
        code = self._lib.ma_t_category(ptr) if ptr else -1
        return None if code < 0 else CATEGORY_NAMES[code]

    # --- steps -------------------------------------------------------------------------
    def now_seq(self) -> int:
        return self._lib.ma_t_next_seq()

    def now_ns(self) -> int:
        return self._clock() - self.start_ns

    # --- output ------------------------------------------------------------------------
    def _events(self) -> np.ndarray:
        n = self._lib.ma_t_event_count()
        events = np.empty(n, EVENT_DTYPE)
        if n:
            self._lib.ma_t_copy_events(events.ctypes.data, n)
        return events


    def _pairs(self, count_fn, copy_fn) -> dict[int, int]:
        n = count_fn()
        sids, values = np.empty(n, np.int64), np.empty(n, np.int32)
        n = copy_fn(sids.ctypes.data, values.ctypes.data, n)
        return dict(zip(sids[:n].tolist(), values[:n].tolist()))

    def _op_names(self) -> list[str]:
        buf = ctypes.create_string_buffer(512)
        names = []
        for i in range(self._lib.ma_t_op_count()):
            self._lib.ma_t_op_name(i, buf, len(buf))
            names.append(buf.value.decode())
        return names

    def _dtype_names(self, codes) -> dict[int, str]:
        import torch
        buf = ctypes.create_string_buffer(64)
        names = {-1: schema.RAW_BYTES_DTYPE}
        for code in codes:
            if code < 0 or code in names:
                continue
            n = self._lib.ma_t_dtype_name(int(code), buf, len(buf))
            c10 = buf.value.decode() if n >= 0 else f"scalar_type_{code}"
            name = _C10_DTYPES.get(c10) or (c10.lower() if hasattr(torch, c10.lower()) else c10)
            names[int(code)] = name
        return names

    def _sources(self) -> list[tuple[str, int, str]]:
        pairs: list = []
        self._lib.ma_t_sources_into(pairs)
        return [(code.co_filename, line, code.co_name) for code, line in pairs]

    def to_table(self, step_boundaries: list[int]) -> pa.Table:
        """Resolve steps and categories and build the events table."""
        ev = self._events()
        n = len(ev)
        sids = ev["sid"]
        is_alloc = ev["kind"] > 0
        n_sids = int(sids.max()) + 1 if n else 0
        # a free row repeats its allocation's identity (op, dtype, shape, module, source):
        # taken from the alloc row, which may have been completed after the free was copied
        alloc_row = np.zeros(n_sids, np.int64)
        alloc_row[sids[is_alloc]] = np.nonzero(is_alloc)[0]
        ident = ev[alloc_row[sids]] if n else ev
        # category per storage: its mark, else the rule the dispatch engine applies
        category = np.full(n_sids, _UNMARKED, np.int32)
        for sid, code in self._pairs(self._lib.ma_t_mark_count,
                                     self._lib.ma_t_copy_marks).items():
            if sid < n_sids:
                category[sid] = code
        alloc_phase = np.full(n_sids, -1, np.int32)
        alloc_phase[sids[is_alloc]] = ev["phase"][is_alloc]
        freed_in_backward = np.zeros(n_sids, bool)
        freed_in_backward[sids[~is_alloc & (ev["phase"] == PHASE_CODES[schema.BACKWARD])]] = True
        unmarked = category == _UNMARKED
        forward, other = PHASE_CODES[schema.FORWARD], PHASE_CODES[schema.OTHER_PHASE]
        category[unmarked & (alloc_phase == forward) & freed_in_backward] = \
            CATEGORY_CODES[schema.ACTIVATION]
        unmarked = category == _UNMARKED
        category[unmarked & (alloc_phase == other)] = CATEGORY_CODES[schema.OTHER]
        category[category == _UNMARKED] = CATEGORY_CODES[schema.TEMPORARY]
        category_names = np.array(CATEGORY_NAMES, dtype=object)

        ops = np.array([""] + self._op_names(), dtype=object)
        modules = np.array(self._module_names, dtype=object)
        module_ids = ident["module"].copy()
        owners = self._pairs(self._lib.ma_t_owner_count, self._lib.ma_t_copy_owners)
        if owners:
            owner_of = np.full(n_sids, -1, np.int32)
            for sid, module in owners.items():
                if sid < n_sids:
                    owner_of[sid] = module
            owned = owner_of[sids]
            module_ids = np.where(owned >= 0, owned, module_ids)
        phases = np.array([PHASE_NAMES[i] for i in range(len(PHASE_NAMES))], dtype=object)

        # dtype and shape: the op's output tensor; raw bytes (size) for kernel scratch;
        # what Python said for external storages
        n_shapes = self._lib.ma_t_shape_count()
        pool = np.empty(n_shapes, np.int64)
        if n_shapes:
            self._lib.ma_t_copy_shapes(pool.ctypes.data, n_shapes)
        pool = pool.tolist()
        dtype_names = self._dtype_names(np.unique(ident["dtype"]).tolist())
        shape_cache: dict[tuple[int, int], str] = {}
        dtypes, shapes = [], []
        external = self._external
        for sid, dtype, shape_at, size in zip(sids.tolist(), ident["dtype"].tolist(),
                                              ident["shape"].tolist(), ev["size"].tolist()):
            ext = external.get(sid)
            if ext is not None:
                dtypes.append(ext[1])
                shapes.append(ext[2])
                continue
            dtypes.append(dtype_names[dtype])
            key = (shape_at, size if shape_at < 0 else 0)
            text = shape_cache.get(key)
            if text is None:
                if shape_at < 0:
                    text = str(size)
                else:
                    ndim = pool[shape_at]
                    text = schema.shape_to_str(pool[shape_at + 1: shape_at + 1 + ndim])
                shape_cache[key] = text
            shapes.append(text)
        devices = [external[sid][0] if sid in external else "cpu" for sid in sids.tolist()] \
            if external else ["cpu"] * n

        sources = [("", 0, "")] + self._sources()
        source_index = ident["source"] + 1
        files = np.array([s[0] for s in sources], dtype=object)
        lines = np.array([s[1] for s in sources], dtype=np.int32)
        funcs = np.array([s[2] for s in sources], dtype=object)

        columns: dict[str, Any] = {
            "seq": np.arange(n, dtype=np.int64),
            "time_ns": ev["time_ns"].astype(np.int64),
            "action": np.where(is_alloc, schema.ALLOC, schema.FREE).astype(object).tolist(),
            "storage_id": sids.astype(np.int64),
            "size_bytes": ev["size"].astype(np.int64),
            "device": devices,
            "dtype": dtypes,
            "shape": shapes,
            "category": category_names[category[sids]].tolist() if n else [],
            # blocks made outside any op that no op claimed (OP_UNCLAIMED: the CPU RNG
            # state torch.utils.checkpoint keeps, buffers compiled code allocates): no op
            "op": ops[np.maximum(ident["op"], -1) + 1].tolist(),
            "module": modules[module_ids].tolist(),
            "phase": phases[ev["phase"]].tolist(),
        }
        boundaries = np.asarray(sorted(step_boundaries), dtype=np.int64)
        columns["step"] = np.searchsorted(boundaries, columns["seq"],
                                          side="right").astype(np.int32)
        columns["source_file"] = files[source_index].tolist()
        columns["source_line"] = lines[source_index]
        columns["source_function"] = funcs[source_index].tolist()
        columns["input_ids"] = self._input_ids(n)
        return events_table(columns)

    def _input_ids(self, n: int) -> pa.Array:
        """The trace's ``input_ids``: per output alloc event, the ids its op read."""
        lib = self._lib
        pool = np.empty(lib.ma_t_input_pool_count(), np.int64)
        if len(pool):
            lib.ma_t_copy_input_pool(pool.ctypes.data, len(pool))
        refs = np.empty((lib.ma_t_input_ref_count(), 3), np.int64)
        if len(refs):
            lib.ma_t_copy_input_refs(refs.ctypes.data, len(refs))
        refs = refs[(refs[:, 0] < n) & (refs[:, 1] + refs[:, 2] <= len(pool))]
        refs = refs[np.argsort(refs[:, 0], kind="stable")]
        refs = refs[np.concatenate([[True], np.diff(refs[:, 0]) > 0])] if len(refs) else refs
        counts = np.zeros(n, np.int64)
        counts[refs[:, 0]] = refs[:, 2]
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        # each ref's ids, in event order: pool[start + 0 .. start + count - 1]
        starts = np.repeat(refs[:, 1], refs[:, 2])
        within = np.arange(len(starts)) - np.repeat(offsets[:-1][refs[:, 0]], refs[:, 2])
        values = pool[starts + within] if len(starts) else np.zeros(0, np.int64)
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, pa.int64()))

    def op_stats(self) -> dict[tuple[str, str, str], list[int]]:
        """(module, phase, op) -> [calls, FLOPs], like the dispatch engine's."""
        lib = self._lib
        ops = [""] + self._op_names()
        stats: dict[tuple[str, str, str], list[int]] = {}
        n = lib.ma_t_call_count()
        keys, calls = np.empty(3 * n, np.int32), np.empty(n, np.int64)
        n = lib.ma_t_copy_calls(keys.ctypes.data, calls.ctypes.data, n)
        for i in range(n):
            module, phase, op = keys[3 * i: 3 * i + 3].tolist()
            stats[(self._module_names[module], PHASE_NAMES[phase], ops[op + 1])] = \
                [int(calls[i]), 0]
        n = lib.ma_t_flop_call_count()
        if not n:
            return stats
        records = np.empty(4 * n, np.int32)
        lib.ma_t_copy_flop_calls(records.ctypes.data, n)
        flops_of: dict[int, int] = {}
        buf = np.empty(256, np.int64)
        for i in range(n):
            module, phase, op, args_id = records[4 * i: 4 * i + 4].tolist()
            flops = flops_of.get(args_id)
            if flops is None:
                length = lib.ma_t_flop_args(args_id, buf.ctypes.data, len(buf))
                if length > len(buf):
                    buf = np.empty(length, np.int64)
                    lib.ma_t_flop_args(args_id, buf.ctypes.data, len(buf))
                flops = flops_of[args_id] = self._flops(ops[op + 1], buf[:length].tolist())
            key = (self._module_names[module], PHASE_NAMES[phase], ops[op + 1])
            stats.setdefault(key, [0, 0])[1] += flops
        return stats

    def _flops(self, op: str, values: list[int]) -> int:
        formula = self._formulas.get(op)
        if formula is None:
            return 0
        try:
            inputs, out = decode_args(values)
            args, kwargs = _split_by_schema(op, inputs)
            return int(formula(*args, **kwargs, out_val=out))
        except Exception:  # a formula that does not fit this overload: no estimate
            return 0


_SCHEMAS: dict[tuple[str, int], list[tuple[str, bool]] | None] = {}


def _split_by_schema(op: str, inputs: list) -> tuple[list, dict]:
    """RecordFunction hands every schema argument over positionally; the FLOP formulas
    take keyword-only ones (addmm's beta, alpha) as keywords, like a call from Python."""
    key = (op, len(inputs))
    arguments = _SCHEMAS.get(key, ...)
    if arguments is ...:
        arguments = None
        import torch
        namespace, _, name = op.partition("::")
        packet = getattr(getattr(torch.ops, namespace, None), name, None)
        for overload in (packet.overloads() if packet is not None else []):
            schema_args = getattr(packet, overload)._schema.arguments
            if len(schema_args) == len(inputs):
                arguments = [(a.name, a.kwarg_only) for a in schema_args]
                break
        _SCHEMAS[key] = arguments
    if arguments is None:
        return inputs, {}
    args = [v for v, (_, kw_only) in zip(inputs, arguments) if not kw_only]
    kwargs = {name: v for v, (name, kw_only) in zip(inputs, arguments) if kw_only}
    return args, kwargs
