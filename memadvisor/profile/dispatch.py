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
from torch.utils._pytree import tree_flatten

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
        self._native = None
        self._native_next_seq = None
        self._internal_blocks: dict[int, int] = {}  # data ptr -> alloc row
        #: set by the session: notices the start of backward before the op is logged
        self.before_op = lambda args, kwargs: None
        #: ``after_op(op_name, args, out)`` once an op's outputs are logged, where a caller adds
        #: memory a kernel holds that is no tensor (fake execution's cuBLAS workspaces)
        self.after_op = None
        #: ``kernel_blocks(func, args, kwargs, out)``: the blocks a real kernel of this op
        #: would allocate, in order (fake execution on the CPU target measures them,
        #: ``cpu_scratch.py``), or None
        self.kernel_blocks = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.before_op(args, kwargs)
        native = self.native
        if native is not None:
            # events from here on are this op's; older pending ones happened between ops
            first_seq = self._native_next_seq()
        recorder = self.recorder
        phase = recorder.phase
        op_name = self._op_names.get(func)
        if op_name is None:
            op_name = self._op_names[func] = _op_name(func)
        read = []  # the storages this op reads: the data flow its outputs record
        for tensor in _tensors(args, kwargs):
            storage = _storage(tensor)
            if storage is None:
                continue
            created = recorder.created_phase(storage)
            if created is None:
                if _looks_only(func) and _in_shared_memory(storage):
                    continue  # a worker's batch: logged when an op computes from it (below)
                self._log_alloc(tensor, storage, op_name)
            elif phase == schema.FORWARD and created == schema.OTHER_PHASE \
                    and recorder.category_of(storage) is None:
                # made between steps and fed to the forward: the batch (or targets)
                recorder.mark(storage, schema.INPUT)
            sid = recorder.lookup(storage)
            if sid is not None:
                read.append(sid)
        inputs = tuple(read)
        out = func(*args, **kwargs)
        if native is not None:
            self._absorb_native(native.drain_lists(), out, op_name, first_seq, inputs)
        elif self.kernel_blocks is not None:
            blocks = self.kernel_blocks(func, args, kwargs, out)
            if blocks:
                self._absorb_measured(blocks, out, op_name, inputs)
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
            if op_name == "aten::set_" and _in_shared_memory(storage):
                # a DataLoader worker's batch, rebuilt on its shared-memory pages: no
                # allocation of this process's allocator (the native engine sees none).
                # Like the native engine, it is logged when an op first computes from it,
                # not when it arrives or is looked at (``is_pinned``, a slice): batches
                # waiting in the loader's queue, or fetched ahead by accumulation's loop,
                # are no allocator memory (zoo/resnet_dataloader: a fake run 2.4% over
                # the real one, 3.4-3.8% under accum=2 and data parallel)
                continue
            self._log_alloc(tensor, storage, op_name, inputs=inputs)
        if cast and _is_parameter_cast(recorder, args):
            # autocast's low-precision copy of a weight (cached for the whole forward)
            for storage in map(_storage, _tensors(out, None)):
                if storage is not None:
                    recorder.mark(storage, schema.AUTOCAST_WEIGHT)
        if self.after_op is not None:
            self.after_op(op_name, args, out)
        key = (recorder.module, phase, op_name)
        stats = self.op_stats.get(key)
        if stats is None:
            stats = self.op_stats[key] = [0, 0]
        stats[0] += 1
        stats[1] += self.flop_counter.flops(func, args, kwargs, out)
        return out

    @property
    def native(self):
        """The native CPU allocator hook (memadvisor.profile.native), when available."""
        return self._native

    @native.setter
    def native(self, hook) -> None:
        self._native = hook
        # bound once: a plain ctypes call is the cheapest way to ask it per op
        self._native_next_seq = None if hook is None else hook._lib.ma_next_seq

    def _absorb_native(self, drained, out, op_name: str, first_seq: int,
                       inputs: tuple[int, ...] = ()) -> None:
        """Merge the allocator hook's events of one op, in the allocator's order: output
        storages are logged where they were allocated, kernel-internal blocks (oneDNN
        scratch, reorders) as raw buffers, so the peak inside the op is exact.  Events
        before ``first_seq`` happened between ops: only frees of internal blocks matter."""
        kinds, ptrs, sizes, seqs = drained
        if not kinds:
            return
        outputs = {}
        if out is not None and seqs[-1] >= first_seq:
            # new storages, and known ones an op may have re-allocated (out= resize)
            for tensor in _tensors(out, None):
                storage = _storage(tensor)
                if storage is not None:
                    outputs[storage.data_ptr()] = (tensor, storage)
        internal = self._internal_blocks
        # an address can serve a scratch block first and the output after it: the output
        # is the last allocation at its address in this op
        last_alloc = {}
        for index, (kind, ptr) in enumerate(zip(kinds, ptrs)):
            if kind > 0 and ptr in outputs:
                last_alloc[ptr] = index
        source = None
        for index, (kind, ptr, size, seq) in enumerate(zip(kinds, ptrs, sizes, seqs)):
            if kind > 0:
                if seq < first_seq:
                    continue  # made between ops (torch.tensor(list), ...): logged at first use
                if last_alloc.get(ptr) == index:
                    tensor, storage = outputs[ptr]
                    # the allocation can be larger than the storage (oneDNN rounds up)
                    size = max(size, storage.nbytes())
                    if self.recorder.lookup(storage) is None:
                        self._log_alloc(tensor, storage, op_name, size, inputs)
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

    def _absorb_measured(self, blocks, out, op_name: str, inputs: tuple[int, ...]) -> None:
        """Log a fake op's outputs and the raw blocks its real kernel takes in the order a
        measurement of that kernel saw them (``kernel_blocks``): ``(+1, slot, bytes)`` an
        output (``slot``: its position among the flattened outputs; an allocation larger
        than the storage keeps its real size) or a raw block (``slot`` a name), ``(-1, name,
        0)`` a raw block freed.  Outputs not in ``blocks`` are logged after, as usual."""
        outputs = [item for item in tree_flatten(out)[0] if isinstance(item, _Tensor)]
        internal = {}
        source = None
        for kind, slot, size in blocks:
            if isinstance(slot, int):
                if slot >= len(outputs):
                    continue
                tensor = outputs[slot]
                storage = _storage(tensor)
                if storage is not None and self.recorder.lookup(storage) is None:
                    self._log_alloc(tensor, storage, op_name, max(size, storage.nbytes()),
                                    inputs)
            elif kind > 0:
                if source is None:
                    source = self.locator.locate(2)
                internal[slot] = self.recorder.internal_alloc(size, "cpu", op_name, source)
            else:
                row = internal.pop(slot, None)
                if row is not None:
                    self.recorder.internal_free(row)
        for row in internal.values():
            self.recorder.internal_free(row)

    def _log_alloc(self, tensor, storage, op_name: str, size_bytes: int | None = None,
                   inputs: tuple[int, ...] = ()) -> None:
        device = tensor.device
        if device.type in _SKIP_DEVICES:
            return
        if self._internal_blocks:
            # a block an earlier op made for itself, now handed out as a tensor (gloo clones
            # a reduce-scatter's input inside the op and splits the clone after it): the
            # same memory, now a storage -- not new bytes
            row = self._internal_blocks.pop(storage.data_ptr(), None)
            if row is not None:
                self.recorder.internal_free(row)
        dtype = self._dtype_names.get(tensor.dtype)
        if dtype is None:
            dtype = self._dtype_names[tensor.dtype] = str(tensor.dtype).removeprefix("torch.")
        self.recorder.alloc(storage, str(device), dtype, self._shape(tensor), op_name,
                            self.locator.locate(3), size_bytes, inputs)

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


_IS_PINNED = torch.ops.aten.is_pinned.default


def _looks_only(func) -> bool:
    """An op that reads no element of its input: a view of it, or a question about it."""
    return func is _IS_PINNED or func.is_view


def _in_shared_memory(storage) -> bool:
    try:
        return bool(storage.is_shared()) and storage.device.type == "cpu"
    except (RuntimeError, NotImplementedError, AttributeError):  # fake, meta storages
        return False


def _tensors(args, kwargs) -> list:
    """Every plain tensor in args/kwargs/outputs (lists nested as aten uses them; wrapper
    subclasses such as DTensor looked through).  A list, not a generator: this runs
    several times per op and a plain loop is the cheapest."""
    found = []
    pending = None
    for value in (args if kwargs is None or not kwargs else (*args, *kwargs.values())) \
            if isinstance(args, (list, tuple)) else (args,):
        if type(value) is _Tensor:
            found.append(value)
        elif isinstance(value, _Tensor) or isinstance(value, (list, tuple)):
            if pending is None:
                pending = []
            pending.append(value)
    while pending:
        value = pending.pop()
        if isinstance(value, _Tensor):
            if type(value) is not _Tensor and is_traceable_wrapper_subclass(value):
                inner_names, _ = value.__tensor_flatten__()
                pending.extend(getattr(value, name) for name in inner_names)
            else:
                found.append(value)
        elif isinstance(value, (list, tuple)):
            pending.extend(value)
    return found


def _is_parameter_cast(recorder: EventRecorder, args) -> bool:
    if not args or not isinstance(args[0], _Tensor):
        return False
    storage = _storage(args[0])
    return storage is not None and recorder.category_of(storage) == schema.PARAMETER
