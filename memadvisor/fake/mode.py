"""The fake tensor mode fake execution runs under: FakeTensorMode plus three answers.

1. Ops that read values (``item``, ``bool``, ``nonzero``, ...) get placeholders
   (``placeholders.py``) instead of FakeTensorMode's DataDependentOutputException.
2. Stream bookkeeping ops (``record_stream``) are no-ops: there is one timeline; pinning
   host memory (``pin_memory``) copies.
3. Ops that have no fake or meta kernel (custom CUDA extensions, some CUDA-only ops)
   raise :class:`FakeOpUnsupported` naming the op, instead of an internal exception or
   FakeTensorMode's attempt to run a real kernel on invented data.

4. A small real CPU tensor copied to the GPU keeps its values for the way back: its
   ``.cpu()`` is the real tensor again, as on a GPU (sequence lengths and sort orders make
   that round trip: ``pack_padded_sequence`` / ``pad_packed_sequence`` index with them).
   Any other fake tensor copied to the CPU is a fake CPU tensor, never invented values.

Every fake CUDA tensor an op returns has its storage counted by ``memory.LiveFakeBytes``.
"""
from __future__ import annotations

import weakref

import torch
from torch._subclasses.fake_tensor import (_DISPATCH_META_HANDLERS,
                                           DataDependentOutputException,
                                           DynamicOutputShapeException, FakeTensor,
                                           FakeTensorMode, UnsupportedOperatorException)
from torch.utils._pytree import tree_iter

from . import packed, placeholders, real_cpu
from .memory import LiveFakeBytes
from .norm_statistics import cpu_mixed_statistics

_aten = torch.ops.aten
#: ``_c10d_functional.wait_tensor``: returns its input (see ``dispatch``)
_WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default
_NO_OPS = frozenset({_aten.record_stream.default})
_VALUE_READS = placeholders.SCALAR_OPS | placeholders.TRUE_OPS | placeholders.UPPER_BOUND_OPS


class FakeOpUnsupported(RuntimeError):
    """An op cannot run on fake tensors; ``op`` names it (``mylib::fused_kernel``)."""

    def __init__(self, op: str, reason: str, location: str):
        self.op, self.reason, self.location = op, reason, location
        super().__init__(f"{op} cannot run under fake execution ({reason}), called from "
                         f"{location}; a custom op needs a fake kernel "
                         f"(torch.library.register_fake) to be profiled without a GPU")


def _is_small_real_cpu(value) -> bool:
    return (isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor)
            and value.device.type == "cpu" and value.numel() <= real_cpu.REAL_ELEMENTS_LIMIT)


def _op_name(func) -> str:
    name = getattr(func, "name", None)
    return name() if callable(name) else str(func)


class SimulatedGpuMode(FakeTensorMode):
    """FakeTensorMode that answers value reads with placeholders and counts live bytes."""

    def __init__(self, *, live_bytes: LiveFakeBytes | None = None,
                 placeholder_log: placeholders.PlaceholderLog | None = None,
                 real_cpu: bool = False, real_cpu_integers: bool = False):
        # real tensors (CPU data, numpy-made batches) mix in freely: they are converted
        # to fake tensors when an op meets them, as a copy to the GPU would
        super().__init__(allow_non_fake_inputs=True)
        self.live_bytes = live_bytes if live_bytes is not None else LiveFakeBytes()
        self.placeholder_log = placeholder_log or placeholders.PlaceholderLog()
        #: small CPU tensors computed for real (``real_cpu.py``): on a simulated GPU
        self.real_cpu = real_cpu
        #: on the CPU target: only small integer and bool results for real (real_cpu.py)
        self.real_cpu_integers = real_cpu_integers and not real_cpu
        #: data pointers of real tensors a fake op wrote into (real_cpu.mark_stale)
        self._stale_real: set[int] = set()
        #: id(fake copy on the GPU) -> (weak reference to it, the small real CPU tensor it
        #: was copied from) (4. above); keyed by id: tensors compare elementwise, so a
        #: WeakKeyDictionary cannot hold them
        self._host_values: dict[int, tuple] = {}

    def __deepcopy__(self, memo):
        # a fake tensor keeps its mode in its __dict__, which Tensor.__deepcopy__ copies:
        # a deep copy (an EMA model, nn.Transformer's cloned layers, torchmetrics' states)
        # must share the one mode, not clone it (its locks cannot be copied anyway)
        return self

    @property
    def avoid_device_init(self) -> bool:
        # FakeTensorMode constant-folds ops on real inputs by running them for real unless
        # the target device is unavailable; with torch.cuda.is_available() patched to
        # True it would run a real copy to 'cuda' (no CUDA kernels here).  There is never
        # a device to initialise under fake execution.
        return True

    def dispatch(self, func, types, args=(), kwargs=None):
        metadata = _DISPATCH_META_HANDLERS.get(func)
        if metadata is not None and args and isinstance(args[0], FakeTensor):
            # a fake tensor's device (or size, stride) asked from C++: most ops dispatched
            # are these; FakeTensorMode answers them from the tensor alone, before
            # anything below could apply (no value read, no real CPU op, nothing made)
            self.placeholder_log.ops_dispatched += 1
            return metadata(args)
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if isinstance(device, torch.device) and device.type == "cpu" and device.index is not None:
            # a real CPU tensor made on 'cpu:0' is on 'cpu' (the index is dropped); a fake
            # one kept it and then mismatched every other CPU tensor (the HF Trainer's
            # ranks on the CPU)
            kwargs = {**kwargs, "device": torch.device("cpu")}
        if func in _NO_OPS:
            return None
        if func is _aten._pin_memory.default:
            # DataLoader(pin_memory=True) pins each batch: host memory, which fake
            # execution does not model; a copy keeps the batch usable
            return super().dispatch(_aten.clone.default, types, (args[0],), {})
        if func is _aten.is_pinned.default:
            return False
        if func is _WAIT_TENSOR and args and isinstance(args[0], FakeTensor):
            # a functional collective's wait hands back its input (the same storage, as
            # c10d's kernel does); the meta kernel made a new one: a second copy of every
            # tp all-reduce's output (+64 KiB on the Llama decoder's head under tp=2)
            return args[0]
        if func is _aten._to_copy.default and args:
            copied = self._host_round_trip(args[0], kwargs)
            if copied is not None:
                return copied
        if self.real_cpu or self.real_cpu_integers:
            if real_cpu.runs_for_real(func, args, kwargs, _VALUE_READS,
                                      integers_only=self.real_cpu_integers,
                                      stale=self._stale_real):
                return func(*args, **kwargs)  # this mode is off inside its own dispatch
            real_cpu.mark_stale(func, args, kwargs, self._stale_real)
        handler = packed.HANDLERS.get(func)
        if handler is not None:  # shapes from real lengths (packed.py)
            out = handler(self._empty, *args, **kwargs)
            if out is not NotImplemented:
                self._track(out)
                return out
        answered = placeholders.answer(func, args, kwargs, self.placeholder_log, self._empty)
        if answered is not NotImplemented:
            self._track(answered)
            return answered
        self.placeholder_log.ops_dispatched += 1
        try:
            out = super().dispatch(func, types, args, kwargs)
        except UnsupportedOperatorException:
            raise FakeOpUnsupported(_op_name(func), "no fake or meta kernel",
                                    placeholders.script_location()) from None
        except (DataDependentOutputException, DynamicOutputShapeException) as exc:
            raise FakeOpUnsupported(_op_name(func), f"its output depends on tensor values: "
                                    f"{type(exc).__name__}",
                                    placeholders.script_location()) from None
        except (NotImplementedError, RuntimeError) as exc:
            # custom ops (torch.library) without a fake kernel say so in their message
            if "fake impl" in str(exc) or "register_fake" in str(exc):
                raise FakeOpUnsupported(_op_name(func), "no fake kernel registered",
                                        placeholders.script_location()) from None
            if "Could not run" in str(exc) and "backend" in str(exc):
                # no meta kernel: FakeTensorMode's fallback tried the real kernel, which
                # this build lacks for the simulated device (e.g. a packed RNN, gru.data)
                raise FakeOpUnsupported(_op_name(func), "no fake or meta kernel",
                                        placeholders.script_location()) from None
            raise
        out = cpu_mixed_statistics(func, args, out, self._empty)
        self._track(out)
        if func is _aten._to_copy.default and isinstance(out, FakeTensor) \
                and _is_small_real_cpu(args[0]):
            key = id(out)
            forget = self._host_values.pop
            self._host_values[key] = (weakref.ref(out, lambda _ref: forget(key, None)),
                                      args[0].clone())
        return out

    def _host_round_trip(self, source, kwargs):
        """A fake tensor's copy to the CPU (None: not that op): the real values it was
        made from, or a fake CPU tensor."""
        device = kwargs.get("device")
        if not isinstance(source, FakeTensor) or device is None \
                or torch.device(device).type != "cpu" or source.device.type == "cpu":
            return None
        dtype = kwargs.get("dtype") or source.dtype
        entry = self._host_values.get(id(source))
        if entry is not None and entry[0]() is source and entry[1].shape == source.shape:
            return entry[1].to(dtype=dtype, copy=True)
        return self._empty(source.shape, dtype, torch.device("cpu"))

    def _empty(self, shape, dtype, device):
        return super().dispatch(_aten.empty.memory_format, (), (list(shape),),
                                {"dtype": dtype, "device": device})

    def _track(self, out) -> None:
        if isinstance(out, FakeTensor):
            self.live_bytes.track(out)
            return
        if isinstance(out, (tuple, list)):
            for leaf in tree_iter(out):
                if isinstance(leaf, FakeTensor):
                    self.live_bytes.track(leaf)
