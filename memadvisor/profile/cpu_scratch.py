"""Fake execution on the CPU target: what each op's real CPU kernel allocates besides its
outputs, measured on this machine by running the op once for real.

A real CPU profile sees, through the native allocator hook, the blocks kernels take for
themselves (oneDNN's convolution scratchpads and reorders, ``convolution_backward``'s
im2col buffers, the scalar a ``foreach`` op wraps) and an output allocated larger than its
storage (oneDNN rounds some up).  Fake tensors run no kernel, so a fake CPU run missed
them: the zoo's executed predictions were 3-27% short wherever convolutions ran
(docs/ACCURACY.md, session 15).  Their sizes depend on the shapes, the dtype, the ISA and
the thread count (oneDNN's per-thread buffers), so no rule from shapes carries them from
one machine to another -- they are measured here, per op signature, instead:

* the first time an ``aten`` op runs with a given signature (shapes, strides and dtypes of
  its tensors, its other arguments), it runs once more for real on zero-filled tensors of
  those shapes, with the allocator hook recording (``native.AllocatorHook``, the hook the
  real profile uses), at the thread count the real run has (torchrun gives each rank one
  thread unless ``OMP_NUM_THREADS`` says otherwise);
* the hook's events of that call, in order, become the op's *blocks*: each output's
  allocation (with its real size) and each block allocated and freed inside the op.  The
  dispatch engine logs the fake op's outputs and those blocks in that order
  (``dispatch.RecordingMode.kernel_blocks``), as it logs a real op's;
* later calls with the same signature reuse the measurement.

Not measured (left as fake execution makes them): ops whose output shape depends on values
(``nonzero``: zeros would not be the script's values), ops reading state an earlier kernel
left them (an RNN backward's ``workspace``: zeros are no valid state), ops outside ``aten``
(collectives), arguments that are neither tensors nor plain values (a storage ``set_``
points at), tensors that are not plain strided CPU tensors (a DTensor's op: the ops on its
local tensors, which the dispatch mode sees next, are measured), inputs over
``MAX_PROBE_ELEMENTS``, and any op whose real kernel refuses zeros (counted as
``failed``).  A block a kernel keeps after it returns (not an output) is not
carried: nothing says when the real run frees it.
"""
from __future__ import annotations

import os
import time

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten, tree_map

#: an op whose tensors together hold more elements than this is not run for real
MAX_PROBE_ELEMENTS = 1 << 26
#: wall time all measurements of one run may take; later signatures are left unmeasured
PROBE_BUDGET_S = 120.0
_SKIP_TAGS = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output)
#: argument names of state one kernel leaves for another (``_takes_opaque_state``)
_OPAQUE_ARGUMENTS = ("workspace", "reserve")


def run_threads(num_ranks: int, environ=os.environ) -> int:
    """Threads the real run's kernels use: torchrun starts each of several ranks with
    ``OMP_NUM_THREADS=1`` unless the variable is set; one process keeps torch's default."""
    if num_ranks > 1 and not environ.get("OMP_NUM_THREADS"):
        return 1
    return torch.get_num_threads()


class CpuKernelBlocks:
    """The measurement cache and the dispatch engine's ``kernel_blocks`` callback."""

    def __init__(self, hook, threads: int):
        self._hook = hook
        self.threads = threads
        #: signature -> tuple of (kind, slot, bytes) events, or None (not measurable)
        self._cache: dict = {}
        self.measured = 0
        self.failed = 0
        self.skipped = 0
        self.seconds = 0.0
        self._unmeasurable: set = set()
        #: op name -> the first line its real kernel raised on zeros (a few kept)
        self.failures: dict[str, str] = {}
        #: op name -> how the fake kernel's outputs differ from the real kernel's (dtype,
        #: shape): a fake-execution bug the measurement exposes (a few kept)
        self.mismatches: dict[str, str] = {}

    def summary(self) -> dict:
        """For ``meta.extra['fake']``: what was measured and what was not."""
        return {"signatures_measured": self.measured, "failed": self.failed,
                "skipped": self.skipped, "threads": self.threads,
                "seconds": round(self.seconds, 3), "failures": dict(self.failures),
                "output_mismatches": dict(self.mismatches)}

    def __call__(self, func, args, kwargs, out):
        """The op's blocks, in the allocator's order: ``(+1, slot, bytes)`` for the
        output tensor at ``slot`` (its position in the op's flattened outputs) or a raw
        block (``slot`` a string), ``(-1, slot, 0)`` for a raw block freed.  None: not
        measured (the engine logs the outputs as fake execution made them)."""
        if func in self._unmeasurable:
            return None
        if func.namespace != "aten" or any(tag in func.tags for tag in _SKIP_TAGS) \
                or _takes_opaque_state(func):
            self._unmeasurable.add(func)
            return None
        flat, _ = tree_flatten((args, kwargs))
        key = _signature(func, flat)
        if key is None or sum(t.numel() for t in _tensors(out)) > MAX_PROBE_ELEMENTS:
            return None
        if key in self._cache:
            return self._cache[key]
        events = None
        if self.seconds < PROBE_BUDGET_S:
            started = time.perf_counter()
            events = self._measure(func, args, kwargs, out)
            self.seconds += time.perf_counter() - started
        else:
            self.skipped += 1
        self._cache[key] = events
        return events

    def _measure(self, func, args, kwargs, out):
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        hook = self._hook
        with unset_fake_temporarily():
            real_args, real_kwargs = tree_map(_real_like, (args, kwargs))
            seeded = torch.Tag.nondeterministic_seeded in func.tags
            rng = torch.get_rng_state() if seeded else None
            # a generator the script passed (randint(..., generator=g)) must not advance:
            # the script's data would change
            generators = [(item, item.get_state()) for item in tree_flatten(kwargs)[0]
                          + tree_flatten(args)[0] if isinstance(item, torch.Generator)]
            threads = torch.get_num_threads()
            if threads != self.threads:
                torch.set_num_threads(self.threads)
            hook.drain_lists()  # whatever came before is not this op's
            hook.start()
            try:
                result = func(*real_args, **real_kwargs)
            except Exception as exc:
                self.failed += 1
                if len(self.failures) < 8:
                    self.failures.setdefault(str(func), " ".join(str(exc).split())[:200])
                return None
            finally:
                hook.stop()
                if threads != self.threads:
                    torch.set_num_threads(threads)
                if rng is not None:
                    torch.set_rng_state(rng)
                for generator, state in generators:
                    generator.set_state(state)
            kinds, ptrs, sizes, _ = hook.drain_lists()
            outputs = {}
            real_outputs = _tensors(result)
            for slot, tensor in enumerate(real_outputs):
                outputs.setdefault(tensor.untyped_storage().data_ptr(), slot)
            self._compare(func, _tensors(out), real_outputs)
            events = _blocks(kinds, ptrs, sizes, outputs)
            del result, real_args, real_kwargs
            hook.drain_lists()  # the probe's own frees
        self.measured += 1
        return events

    def _compare(self, func, fake: list, real: list) -> None:
        described = [[(str(t.dtype).removeprefix("torch."), tuple(t.shape)) for t in tensors]
                     for tensors in (fake, real)]
        if described[0] != described[1] and len(self.mismatches) < 8:
            self.mismatches.setdefault(str(func), f"fake {described[0]}, real {described[1]}")


def _blocks(kinds, ptrs, sizes, outputs: dict[int, int]) -> tuple:
    """The hook's events of one call as the op's blocks (see ``CpuKernelBlocks``)."""
    # an address can serve a scratch block first and the output after it: the output is
    # the last allocation at its address
    last_alloc = {}
    for index, (kind, ptr) in enumerate(zip(kinds, ptrs)):
        if kind > 0 and ptr in outputs:
            last_alloc[ptr] = index
    events, live, count = [], {}, 0
    for index, (kind, ptr, size) in enumerate(zip(kinds, ptrs, sizes)):
        if kind > 0:
            if last_alloc.get(ptr) == index:
                events.append((1, outputs[ptr], size))
            else:
                live[ptr] = name = f"b{count}"
                count += 1
                events.append((1, name, size))
        else:
            name = live.pop(ptr, None)
            if name is not None:
                events.append((-1, name, 0))
    # blocks still held when the kernel returned are not carried (module docstring)
    kept = set(live.values())
    return tuple(event for event in events if event[1] not in kept)


def _takes_opaque_state(func) -> bool:
    """An op reading a buffer an earlier kernel filled for it (an RNN's ``workspace``, a
    norm's ``reserve``): zeros in its place are no valid state -- oneDNN's LSTM backward
    crashed the process on them."""
    return any(any(word in argument.name.lower() for word in _OPAQUE_ARGUMENTS)
               for argument in func._schema.arguments)


def _signature(func, flat):
    parts = [func]
    elements = 0
    for item in flat:
        if isinstance(item, torch.Tensor):
            if is_traceable_wrapper_subclass(item) or item.layout != torch.strided \
                    or item.device.type != "cpu" or item.is_quantized or item.is_nested:
                return None  # a DTensor's op: its local tensors' ops are measured
            elements += item.numel()
            parts.append((tuple(item.shape), item.stride(), item.dtype))
        elif isinstance(item, (int, float, bool, str, type(None), torch.dtype,
                               torch.device, torch.memory_format, torch.layout)):
            parts.append(item)
        elif isinstance(item, torch.Generator):
            parts.append("generator")  # its state is kept (``_measure``)
        else:
            return None  # a storage, a process group, an opaque object: nothing to copy
    if elements > MAX_PROBE_ELEMENTS:
        return None
    return tuple(parts)


def _real_like(item):
    """A real tensor shaped like ``item`` (zeros; a real one is copied: the op may write
    into it); anything else as it is."""
    if not isinstance(item, torch.Tensor):
        return item
    from torch._subclasses.fake_tensor import is_fake
    if not is_fake(item):
        return item.clone()
    real = torch.empty_strided(tuple(item.shape), item.stride(), dtype=item.dtype)
    real.zero_()
    return real.requires_grad_(False)


def _tensors(result):
    flat, _ = tree_flatten(result)
    return [item for item in flat if isinstance(item, torch.Tensor)]


__all__ = ["CpuKernelBlocks", "MAX_PROBE_ELEMENTS", "run_threads"]
