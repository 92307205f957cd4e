"""A profiling session: the dispatch mode plus the training hooks that give events meaning.

``with ProfileSession(steps=3) as session: train()`` records; ``session.build()`` returns
the events table and metadata, ``session.write(path)`` writes the trace.

Steps.  A step ends at a ``torch.optim`` optimizer step that follows a backward (global
optimizer hooks), once every optimizer of the models has stepped (optimizer_steps.py).  Scripts that never call a ``torch.optim`` optimizer (manual updates)
fall back to "one backward = one step", the step ending when the next forward begins.
With ``steps=N`` the session raises ``StopProfiling`` (a ``BaseException``, so a user's
``except Exception`` does not swallow it) once N steps are done.

Phases.  forward: from a root module's forward until backward; backward: while the
autograd engine runs (``_current_graph_task_id``), closed by an engine callback;
optimizer: between the optimizer step pre and post hooks, but for a closure's forward and
backward run inside the step (LBFGS, Lightning); other: everything else.
"""
from __future__ import annotations

import os
import threading
import signal
import time
import weakref
from typing import Callable

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook, register_optimizer_step_pre_hook,
)

from ..trace import analysis, schema
from . import metadata
from .batch_capture import BatchObserver, call_kwargs
from .data_loaders import DataLoaderWatch
from .optimizer_steps import OptimizerCycle
from .dispatch import TrackingMode, _storage, _tensors
from .modules import ModuleTracker, clean_path
from .probes import probe_modules
from .recorder import EventRecorder
from .source import SourceLocator
from .value_sizes import ValueReads, ValueSizes


ENGINES = ("auto", "native", "dispatch")


#: how an 'auto' engine's fallback to dispatch begins its reason (the trace keeps it)
NATIVE_UNAVAILABLE = "native engine unavailable"


class StopProfiling(BaseException):
    """Raised inside the script once the requested steps are done."""


class StepTimeout(BaseException):
    """Raised inside the script when a step takes longer than the timeout."""


class ProfileSession:
    def __init__(self, steps: int | None = None, *, step_boundary: str = "auto",
                 timeout_s: float | None = None, script: str | None = None,
                 on_step: Callable[[dict], None] | None = None, native_hook: bool = True,
                 engine: str | None = None, probes: bool = True,
                 recorder: EventRecorder | None = None, cuda_peaks: bool = True):
        if step_boundary not in ("auto", "optimizer", "backward"):
            raise ValueError(f"step_boundary must be auto, optimizer or backward: {step_boundary}")
        engine = engine or os.environ.get("MEMADVISOR_ENGINE") or "auto"
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}: {engine}")
        #: 'native' (per-op work in C++, CPU) or 'dispatch' (a Python TorchDispatchMode);
        #: 'auto' picks native where it can run (see _choose_engine)
        self.engine_requested = engine
        #: measure the script's convolutions and Linear layers in 16-bit after the run
        #: (probes.py; ``memadvisor profile --no-probes`` turns it off)
        self.probes = probes
        self.engine = "dispatch"
        self.engine_status = ""
        self.steps_requested = steps
        self.step_boundary = step_boundary
        self.timeout_s = timeout_s
        self.on_step = on_step
        #: called with the session at each step boundary kept (checkpoint.Checkpoint:
        #: writes the trace so far, so a run that dies without closing leaves its steps)
        self.checkpoint: Callable[["ProfileSession"], None] | None = None
        #: called when the script runs on after StopProfiling (a bare ``except:``)
        self.on_stop_swallowed: Callable[[], None] | None = None
        self.use_native_hook = native_hook
        self.native_status = "off"
        #: ``recorder``: a caller's EventRecorder subclass (fake execution's counts bytes
        #: per device for torch.cuda.memory_allocated); the dispatch engine uses it
        self.recorder = recorder or EventRecorder()
        #: read (and reset) torch.cuda's peaks at each step boundary; off under fake
        #: execution, where they would be the recorder's own figures, not an allocator's
        #: (and the reset would clobber the script's own max_memory_allocated)
        self.cuda_peaks = cuda_peaks
        self.locator = SourceLocator((script,) if script else ())
        self.mode = TrackingMode(self.recorder, self.locator)
        #: the DataLoaders the script iterates: per batch, never per op (data_loaders.py)
        self.data_loaders = DataLoaderWatch(lambda: self.recorder.now_ns(), self.locator)
        self.modules = ModuleTracker(self._set_module, self._root_forward)
        #: lengths of value-dependent results by line, for fake runs of the script
        self.value_sizes = ValueSizes()
        #: scalar values the script read by line, for fake runs of the script
        self.value_reads = ValueReads()
        self._optimizers: weakref.WeakSet = weakref.WeakSet()
        self._optimizer_cycle = OptimizerCycle()  # GANs: one step = every optimizer once
        self._optimizer_depth = 0  # > 0 inside optimizer.step (a closure may run there)
        # (seq, time_ns) of each boundary; step k ends at boundary k
        self._optimizer_boundaries: list[tuple[int, int]] = []
        self._backward_boundaries: list[tuple[int, int]] = []
        self._backward_since_optimizer_step = False
        self._backward_since_forward = False
        self._in_backward = False
        self.backward_count = 0
        #: sum of the trainable parameters' version counters at the first backward's end:
        #: an in-place update (manual SGD) bumps them, accumulation leaves them alone
        self._param_versions_at_first_backward: int | None = None
        self._step_cuda: list[tuple[int | None, int | None]] = []
        #: the batch fed to the model trained (batch_capture.py)
        self.batch_observer = BatchObserver()
        self.modules.on_module_call = self.batch_observer.module_called
        self._last_progress = time.monotonic()
        self._timed_out = False
        self._watchdog: threading.Thread | None = None
        self._stack = []
        self.stopped_at_steps = False
        self._stop_after_backward = False
        self._model_snapshot: dict = {}
        self._original_resize = None
        self._original_get_rng_state = None
        # id(parameter) -> owning module path ('blocks.0.attn'); ids stay valid because the
        # model outlives every step we record
        self._param_owner: dict[int, str] = {}
        #: id(root module) -> [(weakref(tensor), category, owner)] found on it
        self._scanned: dict[int, list] = {}
        self.mode.before_op = self._before_op
        # trainable tensors of scripts without modules: id -> weakref (tensors cannot go in
        # a WeakSet: their == is elementwise)
        self._leaves: dict[int, weakref.ref] = {}

    # --- lifecycle -----------------------------------------------------------------------
    def __enter__(self) -> "ProfileSession":
        self._stack = [
            self.modules.__enter__(),
            register_optimizer_step_pre_hook(self._optimizer_pre),
            register_optimizer_step_post_hook(self._optimizer_post),
        ]
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._saved_hooks.__enter__()
        self.engine, self.engine_status = self._choose_engine()
        if self.engine == "native":
            self.native_status = "on"  # the op tracker includes the allocator hook
            # backward nodes find their module natively: no multi-grad hooks per module call
            self.modules.backward_hooks = False
        else:
            self._start_native_hook()
        self._patch_autograd()
        self._patch_storage_resize()
        self._patch_rng_state()
        self.data_loaders.install()
        self.value_sizes.install()
        self.value_reads.install()
        if self.engine == "dispatch":
            self.mode.__enter__()
        self._last_progress = time.monotonic()
        if self.timeout_s:
            self._arm_timeout_signal()
            self._watchdog = threading.Thread(target=self._watch, daemon=True,
                                              name="memadvisor-timeout")
            self._watchdog.start()
        return self

    def _arm_timeout_signal(self) -> None:
        """The watchdog interrupts the main thread with a signal of its own, SIGVTALRM
        (no one's timer here), whose handler raises KeyboardInterrupt: SIGINT would do
        nothing where it is ignored, as it is for every command a non-interactive shell
        starts in the background (`cmd &`, nohup), and the profiler would wait forever."""
        self._timeout_signal = signal.SIGINT
        self._saved_timeout_handler = None
        if threading.current_thread() is not threading.main_thread() or \
                not hasattr(signal, "SIGVTALRM"):
            return

        def timed_out(signum, frame):
            raise KeyboardInterrupt("memadvisor: step timeout")

        self._saved_timeout_handler = signal.signal(signal.SIGVTALRM, timed_out)
        self._timeout_signal = signal.SIGVTALRM

    def _disarm_timeout_signal(self) -> None:
        if getattr(self, "_saved_timeout_handler", None) is not None and \
                threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGVTALRM, self._saved_timeout_handler)
            self._saved_timeout_handler = None

    def _choose_engine(self) -> tuple[str, str]:
        """The native engine follows CPU memory only (c10's CPU allocator): with a GPU
        present, 'auto' uses the dispatch engine, which sees CUDA storages too."""
        if self.engine_requested == "dispatch":
            return "dispatch", "requested"
        if self.engine_requested == "auto" and torch.cuda.is_available():
            return "dispatch", "a GPU is present (the native engine follows CPU memory only)"
        if not self.use_native_hook:
            return "dispatch", "native hooks switched off"
        from .native import NativeHookUnavailable
        from .native_engine import NativeRecorder, load_library
        try:
            recorder = NativeRecorder(load_library(), self.locator._classify)
            recorder.start()
        except NativeHookUnavailable as exc:
            if self.engine_requested == "native":
                raise
            return "dispatch", f"{NATIVE_UNAVAILABLE}: {exc}"
        self.recorder = recorder
        return "native", "requested" if self.engine_requested == "native" else "auto"

    def _patch_autograd(self) -> None:
        """Backward begins where the script asks for it: wrap the two entry points of the
        autograd engine (Tensor.backward calls the first), so that the seed gradient is
        backward's and the frees at the end of backward are too.  The native engine has
        no per-op Python to notice backward otherwise; the dispatch engine also notices a
        backward that does not come through here (the first op of a graph task)."""
        self._original_autograd = (torch.autograd.backward, torch.autograd.grad)
        session = self

        def wrap(original):
            def run_backward(*args, **kwargs):
                if session._in_backward:  # nested (reentrant checkpoint): one backward
                    return original(*args, **kwargs)
                session._backward_begins(args[0] if args else kwargs.get(
                    "tensors", kwargs.get("outputs")))
                try:
                    return original(*args, **kwargs)
                finally:
                    if session._in_backward:
                        session._backward_done()
            run_backward.__wrapped__ = original
            return run_backward

        torch.autograd.backward = wrap(torch.autograd.backward)
        torch.autograd.grad = wrap(torch.autograd.grad)

    def _backward_begins(self, tensors) -> None:
        self.batch_observer.backward_begins()
        if self.engine != "native":
            self._in_backward = True
            self.recorder.phase = schema.BACKWARD
            return
        # a trainable leaf began a forward (scripts without modules): that is where the
        # step boundary of backward-counted steps lies
        began = self.recorder.take_forward_begin()
        if began >= 0:
            self._forward_begins(at_seq=began)
        if not self.modules.roots:
            for leaf in _graph_leaves(tensors):
                if id(leaf) not in self._leaves:
                    self._leaves[id(leaf)] = weakref.ref(
                        leaf, lambda _r, key=id(leaf): self._leaves.pop(key, None))
                self._mark_tensor(leaf, schema.PARAMETER)
        self._in_backward = True
        # from here on, the seed gradient (ones_like of the loss) included
        self.recorder.phase = schema.BACKWARD

    def _start_native_hook(self) -> None:
        """See allocations made inside kernels too (CPU), when the hook can be built."""
        if not self.use_native_hook:
            self.native_status = "off"
            return
        from .native import AllocatorHook, NativeHookUnavailable
        try:
            hook = AllocatorHook.load()
        except NativeHookUnavailable as exc:
            self.native_status = f"unavailable: {exc}"
            return
        if hook._lib.ma_install() != 0:  # back on top if the op tracker went there since
            self.native_status = "unavailable: another CPU allocator is registered on top"
            return
        hook.clear()
        hook.start()
        self.mode.native = hook
        self.native_status = "on"

    def _patch_storage_resize(self) -> None:
        """``UntypedStorage.resize_`` is no aten op, so the dispatch mode never sees it; FSDP
        frees and re-allocates unsharded parameters exactly that way (``resize_(0)`` after
        forward, ``resize_(n)`` before the all-gather).  Wrap it for the session."""
        original = torch.UntypedStorage.resize_
        self._original_resize = original
        session = self

        def resize_(storage, size):
            if session.engine == "native":
                return session._native_resize(original, storage, size)
            result = original(storage, size)
            session._storage_resized(storage)
            return result

        torch.UntypedStorage.resize_ = resize_

    def _patch_rng_state(self) -> None:
        """``torch.get_rng_state()`` makes a CPU tensor (5,056 B: the generator's state) in
        C++, outside any aten op, so the dispatch mode never sees it; checkpointing keeps
        one per checkpointed call from forward to its recompute, and the recompute's
        ``fork_rng`` makes another for its length (zoo/dcgan checkpoint=auto: 2 x 5,056 B
        at the peak of the real run, missing from the fake one).  The native engine sees
        the block itself; the dispatch engine logs the tensor when it is made."""
        if self.engine == "native":
            return
        original = torch.get_rng_state
        self._original_get_rng_state = original
        mode = self.mode

        def get_rng_state():
            state = original()
            storage = state.untyped_storage()
            if mode.recorder.lookup(storage) is None:
                mode._log_alloc(state, storage, "torch.get_rng_state")
            return state

        get_rng_state.__doc__ = original.__doc__
        torch.get_rng_state = torch.random.get_rng_state = get_rng_state

    def _native_resize(self, original, storage, size):
        """The op tracker sees the blocks (when the storage's allocator is the hooked
        one); name them after resize_ and carry the storage's category over."""
        recorder = self.recorder
        old_ptr, old_sid = storage.data_ptr(), recorder.lookup(storage)
        recorder.op_override("UntypedStorage.resize_")
        try:
            result = original(storage, size)
        finally:
            recorder.op_override(None)
        new_sid = recorder.lookup(storage)
        if old_sid is not None and recorder.is_external(old_sid) and \
                storage.data_ptr() != old_ptr:
            recorder.external_free(old_ptr, old_sid)  # its memory went back unseen
        if new_sid is None and storage.nbytes():
            new_sid = recorder.alloc(storage, str(storage.device), "bytes",
                                     str(storage.nbytes()), "UntypedStorage.resize_")
        if old_sid is not None and new_sid is not None and new_sid != old_sid:
            category = recorder.category_of_sid(old_sid)
            if category is not None:
                recorder.mark_sid(new_sid, category)
        return result

    def _storage_resized(self, storage) -> None:
        recorder = self.recorder
        source = self.locator.locate(2)
        if recorder.lookup(storage) is None:
            if storage.nbytes():
                device = str(storage.device)
                recorder.alloc(storage, device, "bytes", str(storage.nbytes()),
                               "UntypedStorage.resize_", source)
            return
        recorder.check_resize(storage, "UntypedStorage.resize_", str(storage.nbytes()), source,
                              allow_shrink=True)

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if not self._stack:
            return
        if self.engine == "dispatch":
            self.mode.__exit__(None, None, None)
        if getattr(self, "_original_autograd", None) is not None:
            torch.autograd.backward, torch.autograd.grad = self._original_autograd
            self._original_autograd = None
        if self._original_resize is not None:
            torch.UntypedStorage.resize_ = self._original_resize
            self._original_resize = None
        if self._original_get_rng_state is not None:
            torch.get_rng_state = torch.random.get_rng_state = self._original_get_rng_state
            self._original_get_rng_state = None
        self.data_loaders.uninstall()
        self.value_sizes.uninstall()
        self.value_reads.uninstall()
        if self.mode.native is not None:
            self.mode.native.stop()
            self.mode.native.clear()
            self.mode.native = None
        self._saved_hooks.__exit__(None, None, None)
        self.modules.__exit__(None, None, None)
        for handle in self._stack[1:]:
            handle.remove()
        self._stack = []
        self.timeout_s = None  # stops the watchdog
        self._disarm_timeout_signal()
        if self._backward_since_forward and self._counting_backward():
            self._boundary(self._backward_boundaries)  # the script ended after its last step
        self._mark_model_state()
        self._snapshot_model()
        self.recorder.stop()

    # --- training events -----------------------------------------------------------------
    def _set_module(self, name: str) -> None:
        self.recorder.module = name

    def _before_op(self, args, kwargs) -> None:
        self._check_backward_started()
        phase = self.recorder.phase
        if (phase != schema.OTHER_PHASE and phase != schema.FORWARD) or self.modules.roots \
                or not torch.is_grad_enabled():
            return
        # a script without nn.Modules (tensors with requires_grad updated by hand): its
        # forward begins at the first op on a trainable leaf with grad enabled
        found = False
        for tensor in _tensors(args, kwargs):
            if tensor.requires_grad and tensor.is_leaf:
                found = True
                if id(tensor) not in self._leaves:
                    self._leaves[id(tensor)] = weakref.ref(
                        tensor, lambda _r, key=id(tensor): self._leaves.pop(key, None))
                self._mark_tensor(tensor, schema.PARAMETER)
        if found and phase == schema.OTHER_PHASE:
            self._forward_begins()

    def _forward_begins(self, at_seq: int | None = None) -> None:
        self.data_loaders.forward_begins()
        if self.stopped_at_steps:
            self._stop_swallowed()
        if self._backward_since_forward:
            self._backward_since_forward = False
            if self._counting_backward():
                self._boundary(self._backward_boundaries, at_seq)
                if self._stop_after_backward:
                    self.stopped_at_steps = True
                    raise StopProfiling()
        self.recorder.phase = schema.FORWARD

    def _stop_swallowed(self) -> None:
        """The script goes on after its steps were done: a bare ``except:`` (or ``except
        BaseException``) caught StopProfiling.  Nothing more is recorded; the runner may end
        the process (``on_stop_swallowed``), else the stop is raised again."""
        if self.on_stop_swallowed is not None:
            self.on_stop_swallowed()
        self.recorder.stop()
        raise StopProfiling()

    def _root_forward(self, module: torch.nn.Module, args: tuple) -> None:
        # the batch was made between steps (or before profiling began); a loss module's
        # inputs (logits) were made by the forward and are not input data
        batch = []
        for tensor in _tensors(args, None):
            storage = _storage(tensor)
            if storage is None:
                continue
            created = self.recorder.created_phase(storage)
            if created is None or created == schema.OTHER_PHASE:
                batch.append((tensor, storage))
        self._forward_begins()
        if self.engine == "native":
            self.recorder.set_have_roots()
        self._scan_module(module)
        for tensor, storage in batch:
            self._register_existing(tensor, storage)
            self.recorder.mark(storage, schema.INPUT)
        self.batch_observer.root_forward(module, args, call_kwargs(module))
        self.recorder.phase = schema.FORWARD

    def _scan_module(self, module: torch.nn.Module, rescan: bool = False) -> None:
        """Mark a root module's parameters and buffers.  Walking the module tree costs
        more than a small step: it is walked once per root (and again when the session
        closes, or when a parameter it found has died), then the found tensors are kept
        by weak reference and re-marked each step."""
        cached = self._scanned.get(id(module))
        if rescan or cached is None or any(ref() is None for ref, _, _ in cached):
            prefix = self.modules.name_of(module)
            cached = []
            for name, tensor in module.named_parameters():
                owner = _owner_path(prefix, name)
                self._param_owner[id(tensor)] = owner
                cached.append((weakref.ref(tensor), schema.PARAMETER, owner))
            for name, tensor in module.named_buffers():
                cached.append((weakref.ref(tensor), schema.BUFFER, _owner_path(prefix, name)))
            self._scanned[id(module)] = cached
        self._mark_all([(ref(), category, owner) for ref, category, owner in cached])

    def _root_parameters(self) -> list:
        """The trainable parameters of every root module (from the scans)."""
        return [ref() for cached in self._scanned.values() for ref, category, _ in cached
                if category == schema.PARAMETER and ref() is not None]

    def _mark_tensor(self, tensor, category: str, owner: str | None = None) -> None:
        self._mark_all([(tensor, category, owner)])

    def _mark_all(self, items) -> None:
        """Mark (tensor, category, owner or None) triples; storages nobody logged yet are
        registered first.  The native engine does it in one call for all of them."""
        flat = []
        for tensor, category, owner in items:
            if tensor is None:
                continue
            if type(tensor) is torch.Tensor or type(tensor) is torch.nn.Parameter:
                flat.append((tensor, category, owner))
            else:
                flat.extend((inner, category, owner) for inner in _tensors(tensor, None))
        # the native engine marks what it has logged in one call and hands back the rest
        # (not logged yet: external memory, registered first)
        rest = self.recorder.mark_many(flat) if self.engine == "native" else flat
        for tensor, category, owner in rest:
            storage = _storage(tensor)
            if storage is not None:
                self._register_existing(tensor, storage)
                self.recorder.mark(storage, category)
                if owner is not None:
                    self.recorder.set_owner(storage, owner)

    def _register_existing(self, tensor, storage) -> None:
        if self.recorder.lookup(storage) is None:
            if self.engine == "native":
                # memory the allocator hook did not make (numpy, a DataLoader worker's
                # shared memory, unpickled or Python-made storages)
                if tensor.device.type != "meta":
                    self.recorder.alloc(storage, str(tensor.device), _dtype_name(tensor.dtype),
                                        schema.shape_to_str(tensor.shape), "")
            else:
                self.mode._log_alloc(tensor, storage, "")

    def _pack(self, tensor):
        # runs inside forward for every tensor autograd saves; return it unchanged
        if self.recorder.phase != schema.BACKWARD or torch._C._current_graph_task_id() == -1:
            for inner in _tensors(tensor, None):
                storage = _storage(inner)
                if storage is not None and not self.recorder.mark(storage, schema.ACTIVATION) \
                        and self.engine == "native" and storage.nbytes():
                    # memory the native engine never saw made, saved by autograd: data from
                    # outside (a target from a DataLoader worker fed to the loss)
                    self._register_existing(inner, storage)
                    self.recorder.mark(storage, schema.INPUT)
        return tensor

    def _check_backward_started(self) -> None:
        # a backward that did not come through torch.autograd.backward/grad (see
        # _patch_autograd): closed by an engine callback
        if not self._in_backward and torch._C._current_graph_task_id() != -1:
            self.batch_observer.backward_begins()
            self._in_backward = True
            self.recorder.phase = schema.BACKWARD
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _backward_done(self) -> None:
        self._in_backward = False
        self.backward_count += 1
        self._backward_since_optimizer_step = True
        self._backward_since_forward = True
        self.modules.backward_finished()
        self.recorder.phase = schema.OPTIMIZER if self._optimizer_depth else schema.OTHER_PHASE
        trainable = self._root_parameters()
        leaves = [ref() for ref in list(self._leaves.values())]
        owners = self._param_owner
        self._mark_all([(param.grad, schema.GRADIENT, owners.get(id(param)))
                        for param in trainable + [leaf for leaf in leaves if leaf is not None]
                        if param.grad is not None])
        if self._counting_backward():
            if self._param_versions_at_first_backward is None:
                self._param_versions_at_first_backward = _versions(trainable)
            self._maybe_stop_backward_mode(trainable)

    def _counting_backward(self) -> bool:
        return self.step_boundary == "backward" or (
            self.step_boundary == "auto" and not self._optimizer_boundaries)

    def _optimizer_pre(self, optimizer, args, kwargs) -> None:
        if self.stopped_at_steps:
            self._stop_swallowed()
        self._optimizers.add(optimizer)
        # a closure (LBFGS, Lightning's automatic optimization) runs forward and backward
        # inside the step: the update after it is still the optimizer's
        self._optimizer_depth += 1
        self.recorder.phase = schema.OPTIMIZER
        self.recorder.module = ""
        owners = self._param_owner
        items = []
        for group in optimizer.param_groups:
            for param in group["params"]:
                items.append((param, schema.PARAMETER, None))
                if param.grad is not None:
                    items.append((param.grad, schema.GRADIENT, owners.get(id(param))))
        self._mark_all(items)

    def _optimizer_post(self, optimizer, args, kwargs) -> None:
        self._mark_optimizer_state(optimizer)
        self._optimizer_depth = max(self._optimizer_depth - 1, 0)
        self.recorder.phase = schema.OPTIMIZER if self._optimizer_depth else schema.OTHER_PHASE
        if self._optimizer_depth:
            # an optimizer stepped by another's step (ZeroRedundancyOptimizer's local shard
            # optimizer, accelerate's wrapped one): the outer step is the script's, and ends
            # after the inner one (ZeRO broadcasts the updated shards then).  Counted as the
            # step, the shard optimizer covered a part of the parameters, so no step ended,
            # and three backward passes with no step looked like manual updates: a GAN under
            # zero1 stopped profiling after one of its three iterations
            return
        if self._backward_since_optimizer_step and self.step_boundary != "backward":
            self._backward_since_optimizer_step = False
            self._backward_since_forward = False
            owned = set(self._param_owner) | set(self._leaves)
            for seq, time_ns in self._optimizer_cycle.optimizer_stepped(
                    optimizer, owned, self.recorder.now_seq(), self.recorder.now_ns()):
                self._boundary(self._optimizer_boundaries, seq, time_ns)
                if self.steps_requested and \
                        len(self._optimizer_boundaries) >= self.steps_requested:
                    self.stopped_at_steps = True
                    raise StopProfiling()

    def _mark_optimizer_state(self, optimizer) -> None:
        owners = self._param_owner
        self._mark_all([(value, schema.OPTIMIZER_STATE, owners.get(id(param)))
                        for param, state in optimizer.state.items()
                        for value in state.values() if isinstance(value, torch.Tensor)])

    def _mark_model_state(self) -> None:
        for root in self.modules.root_modules():
            self._scan_module(root, rescan=True)
        for optimizer in list(self._optimizers):
            self._mark_optimizer_state(optimizer)

    def _maybe_stop_backward_mode(self, trainable: list) -> None:
        if not self.steps_requested:
            return
        if self.step_boundary == "backward" or not self._optimizer_cycle.expects_optimizer(
                set(self._param_owner) | set(self._leaves)):
            # no torch.optim optimizer holds the model's parameters: updates are manual,
            # one backward is one step (not 11 counted as "step 11/3")
            threshold = self.steps_requested
        elif self._optimizer_depth:
            return  # a closure's backward inside optimizer.step (LBFGS): its step ends it
        elif _versions(trainable) != self._param_versions_at_first_backward:
            # an optimizer holds them, but none has stepped and the parameters were
            # updated in place: manual updates beside an optimizer (used for zero_grad)
            threshold = self.steps_requested
        else:
            # no torch.optim step yet and the parameters untouched: gradient accumulation
            # over many micro-batches (accum=16 made 16 backward passes a step; counting
            # them as steps stopped the run before any optimizer step, exit 0)
            return
        if self.backward_count >= threshold:
            # stop when the next forward begins, after the manual update has run
            self._stop_after_backward = True

    # --- steps -------------------------------------------------------------------------
    def _boundary(self, boundaries: list[tuple[int, int]], at_seq: int | None = None,
                  at_ns: int | None = None) -> None:
        seq = self.recorder.now_seq() if at_seq is None else at_seq
        boundaries.append((seq, self.recorder.now_ns() if at_ns is None else at_ns))
        self.batch_observer.step_ends()
        self._last_progress = time.monotonic()
        cuda = (None, None)
        if self.cuda_peaks and torch.cuda.is_available() and torch.cuda.is_initialized():
            cuda = (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())
            torch.cuda.reset_peak_memory_stats()
        self._step_cuda.append(cuda)
        if len(boundaries) == 1:
            self._snapshot_model()  # once, in case the script drops its model before exit
        provisional = boundaries is self._backward_boundaries and \
            self.step_boundary == "auto" and self._optimizer_cycle.expects_optimizer(
                set(self._param_owner) | set(self._leaves))
        if self.on_step is not None and not provisional:  # progress counts the steps kept
            self.on_step({"steps_done": len(boundaries), "steps_requested": self.steps_requested,
                          "live_bytes": self.recorder.live_bytes,
                          "peak_bytes": self.recorder.peak_bytes})
        if self.checkpoint is not None and not provisional and \
                len(boundaries) != self.steps_requested:  # the last one is written anyway
            self.checkpoint(self)

    def _watch(self) -> None:
        while self.timeout_s:
            time.sleep(0.1)
            if self.timeout_s and time.monotonic() - self._last_progress > self.timeout_s:
                self._timed_out = True
                # a signal, not interrupt_main(): it also wakes a main thread blocked in
                # one C call (sleep, a queue, a hung collective)
                signal.pthread_kill(threading.main_thread().ident,
                                    getattr(self, "_timeout_signal", signal.SIGINT))
                return

    @property
    def timed_out(self) -> bool:
        return self._timed_out

    # --- output ------------------------------------------------------------------------
    def boundaries(self) -> tuple[str, list[tuple[int, int]]]:
        if self._optimizer_boundaries and self.step_boundary != "backward":
            return "optimizer", self._optimizer_boundaries
        return "backward", self._backward_boundaries

    def build(self, *, script: str | None = None, args: list[str] | None = None,
              status: str = "completed", error: str = "", probes: bool = True):
        """The events table and metadata of what was recorded so far; with ``probes`` on
        (here and in the session), also the script's convolutions and Linear layers
        measured in 16-bit (probes.py), after the events are collected."""
        self.close()
        return self._table_and_meta(script, args, status, error, self.probes and probes)

    def snapshot(self, *, script: str | None = None, args: list[str] | None = None,
                 status: str = "completed", error: str = ""):
        """What ``build`` would give now, without ending the recording and without probes:
        the trace kept at step boundaries (checkpoint.py)."""
        return self._table_and_meta(script, args, status, error, False)

    def _table_and_meta(self, script, args, status, error, run_probes: bool):
        detection, boundaries = self.boundaries()
        table = self.recorder.to_table([seq for seq, _ in boundaries])
        op_stats = self._op_stats()
        probes: dict = {}
        if not run_probes and self.probes and self.modules.probe_specs:
            probes = {"skipped": "the run did not complete"}
        elif run_probes and self.modules.probe_specs:
            try:
                probes = probe_modules(self.modules.probe_specs,
                                       lambda: ProfileSession(engine=self.engine, probes=False))
            except (Exception, KeyboardInterrupt) as exc:  # the trace matters more
                probes = {"skipped": f"{type(exc).__name__}: {exc}"[:200]}
        meta = schema.TraceMeta(
            script=os.path.abspath(script) if script else "",
            argv=metadata.argv_of(script, list(args or [])),
            status=status, error=error,
            steps_requested=self.steps_requested or 0,
            steps_completed=len(boundaries),
            step_detection=detection,
            op_stats=[{"module": m, "phase": ph, "op": op, "calls": c, "flops": f}
                      for (m, ph, op), (c, f) in op_stats.items()],
            probes=probes,
            **self._model_snapshot,
        )
        meta.steps = self._step_infos(table, boundaries)
        meta.data_loaders = self.data_loaders.describe([end_ns for _, end_ns in boundaries])
        meta.allocator = {"cpu_native_hook": self.native_status, "engine": self.engine,
                          "engine_reason": self.engine_status}
        if meta.device.startswith("cuda"):
            meta.allocator["settings"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        if self.value_sizes.calls:
            meta.extra["value_sizes"] = self.value_sizes.calls  # profile/value_sizes.py
        if self.value_reads.values:
            meta.extra["value_reads"] = self.value_reads.values
        return table, meta

    def _op_stats(self) -> dict:
        if self.engine == "native":
            return self.recorder.op_stats()
        return self.mode.op_stats

    def _snapshot_model(self) -> None:
        """Describe the model and optimizers while they are alive (we hold no references)."""
        roots = self.modules.root_modules()
        if not roots and not self._leaves and self._model_snapshot:
            return  # the script already dropped its model: keep what we saw last
        named_roots = [(self.modules.name_of(root), root) for root in roots]
        parameters = list({id(p): p for root in roots for p in root.parameters()}.values())
        if not roots:  # a script without nn.Module: its trainable leaf tensors
            parameters = [leaf for leaf in (ref() for ref in self._leaves.values())
                          if leaf is not None]
        device = metadata.main_device(roots)
        batch = dict(self.batch_observer.batch)
        self._model_snapshot = dict(
            parameter_count=sum(p.numel() for p in parameters),
            trainable_parameter_count=sum(p.numel() for p in parameters if p.requires_grad),
            parameter_bytes=metadata.unique_storage_bytes(parameters),
            buffer_bytes=metadata.unique_storage_bytes(b for r in roots for b in r.buffers()),
            optimizers=[metadata.optimizer_info(o) for o in list(self._optimizers)],
            modules=metadata.module_tree(named_roots),
            batch=batch, device=device, device_name=metadata.device_name(device),
            **metadata.machine_info(),
        )

    def _step_infos(self, table, boundaries) -> list[dict]:
        # the same live-bytes definition every reader uses
        live = analysis.live_bytes(table.select(["action", "size_bytes"]).to_pandas())
        infos, start_seq, start_ns = [], 0, 0
        for index, (seq, end_ns) in enumerate(boundaries):
            window = live[start_seq:seq]
            cuda = self._step_cuda[index] if index < len(self._step_cuda) else (None, None)
            infos.append(schema.StepInfo(
                index=index, start_ns=int(start_ns), end_ns=int(end_ns),
                duration_s=(end_ns - start_ns) / 1e9,
                peak_bytes=int(window.max()) if len(window) else 0,
                cuda_max_allocated_bytes=cuda[0], cuda_max_reserved_bytes=cuda[1],
            ).__dict__)
            start_seq, start_ns = seq, end_ns
        return infos

    def write(self, path, **kwargs):
        from ..trace.io import write_trace
        table, meta = self.build(**kwargs)
        return write_trace(path, table, meta)


def _owner_path(prefix: str, name: str) -> str:
    module = clean_path(name.rsplit(".", 1)[0] if "." in name else "")
    return ".".join(p for p in (prefix, module) if p)


def _unpack(tensor):
    return tensor


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _graph_leaves(tensors) -> list:
    """The trainable leaves an autograd graph ends in (its AccumulateGrad nodes)."""
    roots = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors or ())
    pending = [t.grad_fn for t in roots if isinstance(t, torch.Tensor) and t.grad_fn]
    seen, leaves = set(), []
    while pending:
        node = pending.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            leaves.append(variable)
            continue
        pending.extend(next_node for next_node, _ in node.next_functions)
    return leaves


def _versions(parameters: list) -> int:
    """Sum of the tensors' version counters (each in-place write adds one)."""
    return sum(int(p._version) for p in parameters)
