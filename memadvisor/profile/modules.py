"""Which module is running, in forward and in backward, as a path like ``blocks.3.attn``.

Global module hooks push/pop a stack in forward.  Backward has no module calls, so (as
torch's own ModTracker does) each module's forward registers multi-grad hooks: one on its
outputs fires when its backward starts, one on its inputs when its backward ends.

Paths are relative to the *root* module: the first module called while no other module
was running -- or the module whose method called it (a LightningModule's
``training_step`` calling ``self.encoder(x)``, a VAE's ``encode``), so that paths are the
attribute names the user writes.  A second unrelated root (a loss module, a GAN's other
network) is prefixed with the name the calling code holds it by (``netG``, ``criterion``),
else its class name, so paths stay unique.
"""
from __future__ import annotations

import sys
import threading
import weakref
from pathlib import Path
from typing import Any, Callable

import torch
from torch.autograd.graph import _get_grad_fn_or_grad_acc, register_multi_grad_hook
from torch.utils.hooks import RemovableHandle
from torch.nn.modules.module import (
    register_module_forward_hook, register_module_forward_pre_hook,
)
from torch.nn.modules.conv import _ConvNd

from .probes import module_spec

_Tensor = torch.Tensor
_PROBED = (_ConvNd, torch.nn.Linear)


def _grad_tensors(value) -> list[torch.Tensor]:
    found, stack = [], [value]
    while stack:
        item = stack.pop()
        if isinstance(item, _Tensor):
            if item.requires_grad:
                found.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif hasattr(item, "__dataclass_fields__") or hasattr(item, "to_tuple"):
            # model-output containers (HF ModelOutput, dataclasses)
            stack.extend(getattr(item, "__dict__", {}).values())
    return found


def _eager(hook):
    """torch.compile must not trace into a forward hook (weak dictionaries, our own state):
    while dynamo traces, the hook is called through ``torch.compiler.disable`` (a graph
    break: it runs eagerly); otherwise directly, which costs nothing extra."""
    compiler = getattr(torch, "compiler", None)
    disable = getattr(compiler, "disable", None)
    is_compiling = getattr(compiler, "is_compiling", None)
    if disable is None or is_compiling is None:
        return hook
    eager = disable(hook)

    def guarded(*args):
        if is_compiling():
            return eager(*args)
        return hook(*args)
    return guarded


def clean_path(path: str) -> str:
    """torch.compile wraps a model in an OptimizedModule whose child is ``_orig_mod``:
    name the user's modules as they wrote them."""
    if "_orig_mod" not in path:
        return path
    return ".".join(part for part in path.split(".") if part != "_orig_mod")


_TORCH_DIR = str(Path(torch.__file__).parent)
_OWN_DIR = str(Path(__file__).parents[1])


def _user_frames(limit: int = 24):
    """The calling frames outside torch and memadvisor, innermost first."""
    frame = sys._getframe(2)
    while frame is not None and limit:
        name = frame.f_code.co_filename
        if not name.startswith((_TORCH_DIR, _OWN_DIR)):
            yield frame
        frame = frame.f_back
        limit -= 1


#: before Python 3.13 a function frame's ``f_locals`` is a dict snapshot the frame keeps
#: until the next read refreshes it: read once at the first forward, it held that step's
#: batch for the whole run (+1 batch on every later peak; measured on an H100: +2.5% on a
#: U-Net, +1.7% on a ViT, 2026-11-25).  3.13's proxy keeps nothing.
_SNAPSHOT_LOCALS = sys.version_info < (3, 13)
_CO_OPTIMIZED = 0x0001  # a function's frame (fast locals); module and class bodies are not


def _frame_locals(frame) -> dict:
    """A copy of ``frame``'s locals that leaves no reference behind in the frame.  The
    cleared snapshot is harmless: every reader (``locals()``, ``frame.f_locals``, a trace
    function's write-back) refreshes it from the frame's fast locals first."""
    scope = frame.f_locals
    if not _SNAPSHOT_LOCALS or not frame.f_code.co_flags & _CO_OPTIMIZED \
            or scope is frame.f_globals:
        return scope
    values = dict(scope)
    scope.clear()
    return values


def _calling_container(module: torch.nn.Module) -> torch.nn.Module | None:
    """The outermost module whose method (``self`` of a calling frame) holds ``module`` as
    a submodule: the model a framework or a custom method calls a part of."""
    found = None
    for frame in _user_frames():
        owner = _frame_locals(frame).get("self")
        if isinstance(owner, torch.nn.Module) and owner is not module and \
                any(sub is module for sub in owner.modules()):
            found = owner
    return found


def _held_as(module: torch.nn.Module) -> str | None:
    """The name user code holds ``module`` by (a local, a global, ``self.<attribute>``)."""
    for frame in _user_frames():
        local = _frame_locals(frame)
        for scope in (local, frame.f_globals):
            for name, value in list(scope.items()):
                if value is module and name.isidentifier() and name != "self":
                    return name
        owner = local.get("self")
        for name, value in list(getattr(owner, "__dict__", {}).items()):
            if value is module and name.isidentifier():
                return name
    return None


class _Handles:
    def __init__(self, handles: list[RemovableHandle]):
        self._handles = handles

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _when_all_grads_done(tensors: list[torch.Tensor], fn: Callable[[], None]) -> _Handles:
    """Calls ``fn()`` once every tensor's gradient this backward computes has been computed.

    torch's ``register_multi_grad_hook(mode="all")`` (what ModTracker uses) does this by
    keeping each gradient until the last one arrives, to pass them all to its hook: a
    module whose inputs get their gradients far apart (a decoder layer's input and the
    encoder output its cross-attention reads, complete only after the last decoder layer)
    then holds the first gradient alive that long -- memory the script without a profiler
    frees at once (zoo/seq2seq_transformer under checkpointing: +2.5% at the peak).  This
    counts the arrivals and keeps nothing."""
    grad_fns = [_get_grad_fn_or_grad_acc(tensor) for tensor in tensors]
    arrived: dict[int, int] = {}
    expected: dict[int, int] = {}
    lock = threading.Lock()

    def count(_grad):
        task = torch._C._current_graph_task_id()
        with lock:
            if task not in arrived:
                arrived[task] = 0
                # the gradients this backward will compute (not every input is in its graph)
                expected[task] = sum(map(torch._C._will_engine_execute_node, grad_fns))
            arrived[task] += 1
            done = arrived[task] >= expected[task]
            if done:
                del arrived[task], expected[task]
        if done:
            fn()
        return None

    return _Handles([tensor.register_hook(count) for tensor in tensors])


class ModuleTracker:
    """Maintains ``current`` (innermost module path) and calls back on root entry."""

    def __init__(self, on_change: Callable[[str], None],
                 on_root_forward: Callable[[torch.nn.Module, tuple], None],
                 backward_hooks: bool = True):
        self._on_change = on_change
        self._on_root_forward = on_root_forward
        self._names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.roots: list[weakref.ref] = []
        self._forward_stack: list[str] = []
        self._backward_stack: list[str] = []
        self._handles = []
        self._grad_hooks: list = []
        #: False where the module of backward work is known otherwise (the native engine
        #: links each backward node to the forward op that made it)
        self.backward_hooks = backward_hooks
        #: module path -> (kind, how to rebuild it at its last call) for each CPU
        #: convolution and Linear (probes.py)
        self.probe_specs: dict[str, tuple[str, dict]] = {}
        self._probe_shapes: dict[str, Any] = {}
        #: called with (module, args) for every module call in forward (the batch observer
        #: reads the layout of sequence modules there)
        self.on_module_call: Callable[[torch.nn.Module, tuple], None] | None = None

    # --- naming ------------------------------------------------------------------------
    def name_of(self, module: torch.nn.Module) -> str:
        name = self._names.get(module)
        if name is None:
            name = self._adopt_root(module)
        return name

    def _adopt_root(self, module: torch.nn.Module) -> str:
        container = _calling_container(module)
        root = container if container is not None and container not in self._names else module
        if not self.roots:
            prefix = ""
        else:
            taken = {self._names.get(r()) for r in self.roots if r() is not None}
            prefix = _held_as(root) or type(root).__name__
            if prefix in taken:
                prefix = f"{prefix}.{type(root).__name__}"
        self.roots.append(weakref.ref(root))
        for path, sub in root.named_modules(remove_duplicate=False):
            path = clean_path(path)
            full = ".".join(p for p in (prefix, path) if p)
            self._names.setdefault(sub, full)
        return self._names[module]

    def root_modules(self) -> list[torch.nn.Module]:
        return [m for m in (r() for r in self.roots) if m is not None]

    @property
    def current(self) -> str:
        if torch._C._current_graph_task_id() != -1 and self._backward_stack:
            return self._backward_stack[-1]
        return self._forward_stack[-1] if self._forward_stack else ""

    # --- hooks -------------------------------------------------------------------------
    def __enter__(self):
        self._handles = [register_module_forward_pre_hook(_eager(self._pre_forward)),
                         register_module_forward_hook(_eager(self._post_forward),
                                                      always_call=True)]
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _pre_forward(self, module, args):
        if not self._forward_stack and torch._C._current_graph_task_id() == -1:
            if self._grad_hooks and not torch.is_grad_enabled():
                self.remove_grad_hooks()  # an evaluation forward: no backward will come
            self._on_root_forward(module, args)
        name = self.name_of(module)
        self._forward_stack.append(name)
        if self.on_module_call is not None:
            self.on_module_call(module, args)
        if isinstance(module, _PROBED) and args:
            # once per module and input shape (the spec is the same step after step)
            shape = getattr(args[0], "shape", None)
            if self._probe_shapes.get(name) != shape:
                self._probe_shapes[name] = shape
                spec = module_spec(module, args)
                if spec is not None:
                    self.probe_specs[name] = spec
        self._on_change(name)
        if self.backward_hooks and torch._C._current_graph_task_id() == -1:
            inputs = _grad_tensors(args)
            if inputs:
                self._grad_hooks.append(
                    _when_all_grads_done(inputs, self._make_backward_exit(name)))

    def _post_forward(self, module, args, output):
        if self._forward_stack:
            self._forward_stack.pop()
        self._on_change(self.current)
        if self.backward_hooks and torch._C._current_graph_task_id() == -1:
            outputs = _grad_tensors(output)
            if outputs:
                self._grad_hooks.append(register_multi_grad_hook(
                    outputs, self._make_backward_enter(self.name_of(module)), mode="any"))

    def _make_backward_enter(self, name: str):
        def enter(*_):
            self._backward_stack.append(name)
            self._on_change(name)
        return enter

    def _make_backward_exit(self, name: str):
        def leave(*_):
            stack = self._backward_stack
            for i in range(len(stack) - 1, -1, -1):
                if stack[i] == name:
                    del stack[i]
                    break
            self._on_change(self.current)
        return leave

    def backward_finished(self) -> None:
        """Modules whose inputs needed no grad never see their exit hook: clear at the end."""
        self._backward_stack.clear()
        self.remove_grad_hooks()
        self._on_change(self.current)

    def remove_grad_hooks(self) -> None:
        """Hooks on a leaf (a parameter passed as a module's input) would pile up step after
        step: remove each forward's hooks once its backward is done (or a new forward
        begins without one, as in evaluation)."""
        for handle in self._grad_hooks:
            handle.remove()
        self._grad_hooks.clear()
