"""The dispatch mode that sees every aten op (forward, backward and optimizer alike).

For each op: register the *input* storages first (so an in-place or ``out=`` result that
writes into an existing storage is never counted as new memory, and storages made where
we could not see them -- ``torch.tensor(list)``, ``from_numpy`` -- are logged the first
time they are used), run the op, then log every output storage not seen before.
Wrapper subclasses (DTensor, FSDP's sharded parameters) are looked through to the plain
tensors inside.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from ..trace import schema
from .recorder import EventRecorder
from .source import SourceLocator

_Tensor = torch.Tensor
_SKIP_DEVICES = {"meta"}


class TrackingMode(TorchDispatchMode):
    def __init__(self, recorder: EventRecorder, locator: SourceLocator):
        super().__init__()
        self.recorder = recorder
        self.locator = locator
        self.autocast_cast_ops = {torch.ops.aten._to_copy.default}
        self._dtype_names: dict[torch.dtype, str] = {}
        self._shape_names: dict[torch.Size, str] = {}
        self._op_names: dict[object, str] = {}
        #: (module, phase, op) -> [calls, flops]; FLOPs only for the ops that dominate
        self.op_stats: dict[tuple[str, str, str], list[int]] = {}
        self.flop_counter = _FlopCounter()
        #: the native CPU allocator hook (memadvisor.profile.native), when available
        self.native = None
        self._internal_blocks: dict[int, int] = {}  # data ptr -> alloc row
        #: set by the session: notices the start of backward before the op is logged
        self.before_op = lambda args, kwargs: None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.before_op(args, kwargs)
        native = self.native
        if native is not None:
            self._absorb_native(native.drain(), None, "")
        recorder = self.recorder
        phase = recorder.phase
        op_name = self._op_names.get(func)
        if op_name is None:
            op_name = self._op_names[func] = _op_name(func)
        for tensor in _tensors(args, kwargs):
            storage = _storage(tensor)
            if storage is None:
                continue
            created = recorder.created_phase(storage)
            if created is None:
                self._log_alloc(tensor, storage, op_name)
            elif phase == schema.FORWARD and created == schema.OTHER_PHASE \
                    and recorder.category_of(storage) is None:
                # made between steps and fed to the forward: the batch (or targets)
                recorder.mark(storage, schema.INPUT)
        out = func(*args, **kwargs)
        if native is not None:
            self._absorb_native(native.drain(), out, op_name)
        cast = func in self.autocast_cast_ops
        for tensor in _tensors(out, None):
            storage = _storage(tensor)
            if storage is None:
                continue
            if recorder.lookup(storage) is not None:
                if storage.nbytes() > recorder.size_of(storage):
                    recorder.check_resize(storage, op_name, self._shape(tensor),
                                          self.locator.locate(2))
                continue
            self._log_alloc(tensor, storage, op_name)
        if cast and _is_parameter_cast(recorder, args):
            # autocast's low-precision copy of a weight (cached for the whole forward)
            for storage in map(_storage, _tensors(out, None)):
                if storage is not None:
                    recorder.mark(storage, schema.AUTOCAST_WEIGHT)
        key = (recorder.module, phase, op_name)
        stats = self.op_stats.get(key)
        if stats is None:
            stats = self.op_stats[key] = [0, 0]
        stats[0] += 1
        stats[1] += self.flop_counter.flops(func, args, kwargs, out)
        return out

    def _absorb_native(self, drained, out, op_name: str) -> None:
        """Merge the allocator hook's events of one op, in the allocator's order: output
        storages are logged where they were allocated, kernel-internal blocks (oneDNN
        scratch, reorders) as raw buffers, so the peak inside the op is exact."""
        kinds, ptrs, sizes = drained
        if not len(kinds):
            return
        outputs = {}
        if out is not None:
            # new storages, and known ones an op may have re-allocated (out= resize)
            for tensor in _tensors(out, None):
                storage = _storage(tensor)
                if storage is not None:
                    outputs[storage.data_ptr()] = (tensor, storage)
        internal = self._internal_blocks
        kinds, ptrs, sizes = kinds.tolist(), ptrs.tolist(), sizes.tolist()
        # an address can serve a scratch block first and the output after it: the output
        # is the last allocation at its address in this op
        last_alloc = {}
        for index, (kind, ptr) in enumerate(zip(kinds, ptrs)):
            if kind > 0 and ptr in outputs:
                last_alloc[ptr] = index
        source = None
        for index, (kind, ptr, size) in enumerate(zip(kinds, ptrs, sizes)):
            if kind > 0:
                if out is None:
                    continue  # made between ops (torch.tensor(list), ...): logged at first use
                if last_alloc.get(ptr) == index:
                    tensor, storage = outputs[ptr]
                    # the allocation can be larger than the storage (oneDNN rounds up)
                    size = max(size, storage.nbytes())
                    if self.recorder.lookup(storage) is None:
                        self._log_alloc(tensor, storage, op_name, size)
                    else:
                        self.recorder.check_resize(storage, op_name, self._shape(tensor),
                                                   self.locator.locate(2), size)
                    continue
                if source is None:
                    source = self.locator.locate(2)
                internal[ptr] = self.recorder.internal_alloc(size, "cpu", op_name, source)
            else:
                row = internal.pop(ptr, None)
                if row is not None:
                    self.recorder.internal_free(row)

    def _log_alloc(self, tensor, storage, op_name: str, size_bytes: int | None = None) -> None:
        device = tensor.device
        if device.type in _SKIP_DEVICES:
            return
        dtype = self._dtype_names.get(tensor.dtype)
        if dtype is None:
            dtype = self._dtype_names[tensor.dtype] = str(tensor.dtype).removeprefix("torch.")
        self.recorder.alloc(storage, str(device), dtype, self._shape(tensor), op_name,
                            self.locator.locate(3), size_bytes)

    def _shape(self, tensor) -> str:
        size = tensor.shape
        shape = self._shape_names.get(size)
        if shape is None:
            shape = self._shape_names[size] = schema.shape_to_str(size)
        return shape


class _FlopCounter:
    """FLOPs of matmul-like ops, from torch's own formula registry (recompute cost model)."""

    def __init__(self):
        try:
            from torch.utils.flop_counter import flop_registry
        except ImportError:  # pragma: no cover - very old torch
            flop_registry = {}
        self._registry = {getattr(k, "_overloadpacket", k): v for k, v in flop_registry.items()}
        self._cache: dict[tuple, int] = {}

    def flops(self, func, args, kwargs, out) -> int:
        formula = self._registry.get(func._overloadpacket)
        if formula is None:
            return 0
        # the formulas depend on shapes and flags only; they are slow (pytree), so cache
        try:
            key = (func, _shape_key(args), _shape_key(tuple(kwargs.items())))
            cached = self._cache.get(key)
        except TypeError:  # something unhashable in the arguments
            key, cached = None, None
        if cached is not None:
            return cached
        try:
            # the registry's functions take tensors and read their shapes themselves
            flops = int(formula(*args, **kwargs, out_val=out))
        except Exception:  # a formula that does not fit this overload: no estimate
            flops = 0
        if key is not None:
            self._cache[key] = flops
        return flops


def _shape_key(values) -> tuple:
    return tuple(tuple(v.shape) if isinstance(v, _Tensor) else
                 _shape_key(v) if isinstance(v, (list, tuple)) else v for v in values)


def _op_name(func) -> str:
    # 'aten::mm' like torch.profiler names it; overload dropped unless it matters
    name = func.name()
    return name.split(".")[0] if "." in name else name


def _storage(tensor):
    try:
        return tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse, nested, functional wrappers
        return None


def _tensors(args, kwargs):
    """Every plain tensor in args/kwargs/outputs (one level of lists, as aten uses)."""
    stack = [args] if kwargs is None else [args, tuple(kwargs.values())]
    while stack:
        value = stack.pop()
        if isinstance(value, _Tensor):
            if type(value) is not _Tensor and is_traceable_wrapper_subclass(value):
                inner_names, _ = value.__tensor_flatten__()
                stack.extend(getattr(value, name) for name in inner_names)
            else:
                yield value
        elif isinstance(value, (list, tuple)):
            stack.extend(value)


def _is_parameter_cast(recorder: EventRecorder, args) -> bool:
    if not args or not isinstance(args[0], _Tensor):
        return False
    storage = _storage(args[0])
    return storage is not None and recorder.category_of(storage) == schema.PARAMETER
