"""What the script's own code does that the plan cannot run correctly, seen as it first runs
under the plan and stopped there, before the op runs and before any optimizer step:

* a loss that couples the batch's samples (CLIP/SimCLR/InfoNCE: ``a @ b.T`` over in-batch
  negatives) on a plan that splits the batch (accum, data parallelism): each micro-batch
  and rank would compare its samples with only its own, a different loss, not only less
  memory.  ``CouplingWatch`` follows which tensors come from the first micro-batch, from
  the moment ``micro_batches`` hands it out to the first ``backward``; a product of two of
  them whose (m, n) rows and columns count fewer samples than the script's batch is
  refused.  A script that gathers the other ranks' embeddings (``all_gather``, as
  open_clip does under DDP) compares its b samples with the world's: (b, world x b) covers
  the batch and runs.  ``--allow-batch-coupling`` (``ALLOW_ENV``) runs it anyway.
* a 16-bit plan on an op that refuses mixed dtypes (``index_add_``, ``scatter_add_``,
  ``index_put_``, ``lerp_`` ... : autocast covers none of them) whose destination and
  source differ: a buffer the script makes in fp32 (``torch.zeros(n)``) fed 16-bit
  messages, or the reverse; an fp32 EMA copy lerped towards bf16 parameters.
  ``DtypeWatch`` runs through the prepared model's first iteration (first forward to
  second), and raises only where torch itself would.

Both name the script's line (the rewritten script's, with its code) in one PlanError.
"""
from __future__ import annotations

import linecache
import os
import weakref

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from ..plan import PlanError

#: set (to 1) by ``memadvisor apply --allow-batch-coupling``
ALLOW_ENV = "MEMADVISOR_ALLOW_BATCH_COUPLING"

_PAIRWISE = {torch.matmul, torch.mm, torch.Tensor.matmul, torch.Tensor.mm,
             torch.Tensor.__matmul__, torch.Tensor.__rmatmul__, torch.einsum, torch.cdist}

#: ops that refuse a source of another dtype than their destination (measured on torch
#: 2.13: ``copy_``, ``add_`` and ``addcmul_`` cast instead), by name -> index of the source
#: among the positional arguments after ``self`` (or its keyword)
MIXED_DTYPE_REFUSED = {
    "index_add_": 2, "index_add": 2, "scatter_add_": 2, "scatter_add": 2,
    "scatter_": 2, "scatter": 2, "scatter_reduce_": 2, "scatter_reduce": 2,
    "index_copy_": 2, "index_copy": 2, "index_reduce_": 2, "index_reduce": 2,
    "masked_scatter_": 1, "masked_scatter": 1, "index_put_": 1, "index_put": 1,
    "put_": 1, "__setitem__": 1,  # x[index] = v with a tensor index: index_put_
    "lerp_": 0, "lerp": 0}  # the ``end``
_SOURCE_KEYWORDS = ("source", "src", "values", "value")
#: these take a one-element source of another dtype (as a fill value)
_ONE_VALUE_FILLS = ("index_put_", "index_put", "__setitem__")


def allowed_coupling() -> bool:
    return os.environ.get(ALLOW_ENV, "") not in ("", "0")


def _script_line() -> str:
    """``file:line `code``` of the innermost frame of the user's code on the stack."""
    from ..profile.source import SourceLocator
    path, line, _ = SourceLocator().locate(skip=2)
    if not path:
        return "the script"
    code = linecache.getline(path, line).strip()
    return f"{os.path.basename(path)}:{line}" + (f" `{code}`" if code else "")


class CouplingWatch(TorchFunctionMode):
    """Follows the tensors made from one micro-batch of ``micro`` samples (of the script's
    ``batch`` samples) and refuses a pairwise product of two of them that sees fewer
    samples than the script's batch."""

    def __init__(self, part_tensors, micro: int, batch: int, plan_text: str):
        super().__init__()
        self.micro, self.batch, self.plan_text = micro, batch, plan_text
        self._derived: dict[int, weakref.ref] = {}
        for tensor in part_tensors:
            self._mark(tensor)

    def _mark(self, tensor) -> None:
        if isinstance(tensor, torch.Tensor):
            self._derived[id(tensor)] = weakref.ref(tensor)

    def _is_derived(self, tensor) -> bool:
        ref = self._derived.get(id(tensor))
        return ref is not None and ref() is tensor

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():  # dynamo tracing a compiled model: no bookkeeping
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        derived = [t for t in inputs if self._is_derived(t)]
        if not derived:
            return out
        if func in _PAIRWISE and len(derived) >= 2:  # ``z @ z.T`` reads z and its view
            self._check_pairs(out)
        for tensor in tree_flatten(out)[0]:
            self._mark(tensor)
        return out

    def _check_pairs(self, out) -> None:
        if not isinstance(out, torch.Tensor) or out.dim() != 2 or not out.is_floating_point():
            return
        rows, columns = out.shape
        b = self.micro
        if b < 1 or rows % b or columns % b:
            return
        copies = min(rows, columns) // b  # SimCLR's two views: (2b, 2b)
        if max(rows, columns) >= copies * self.batch:
            return  # the other ranks' samples were gathered: it sees the whole batch
        raise PlanError(
            f"the loss couples the samples of a batch: {_script_line()} makes a "
            f"({rows}, {columns}) tensor from two tensors of the batch (in-batch "
            f"similarities): under {self.plan_text} each micro-batch and rank sees {b} of the "
            f"script's {self.batch} samples, so the loss itself changes (fewer in-batch "
            f"negatives), not only the memory; keep the batch whole (no accum, no data "
            f"parallelism), gather the other ranks' embeddings in the script, or pass "
            f"--allow-batch-coupling to run the changed loss")


class DtypeWatch(TorchFunctionMode):
    """Refuses, before it runs, an op of ``MIXED_DTYPE_REFUSED`` whose floating destination
    and source differ in dtype under the plan's precision."""

    def __init__(self, precision: str):
        super().__init__()
        self.precision = precision

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        where = MIXED_DTYPE_REFUSED.get(name)
        if name == "__setitem__" and not _advanced_index(args[1] if len(args) > 1 else None):
            where = None  # basic indexing (slices, ints) copies, casting the source
        if where is not None and args and isinstance(args[0], torch.Tensor):
            source = args[where + 1] if len(args) > where + 1 else next(
                (kwargs[k] for k in _SOURCE_KEYWORDS if k in kwargs), None)
            destination = args[0]
            if name in _ONE_VALUE_FILLS and isinstance(source, torch.Tensor) and \
                    source.numel() == 1:
                source = None  # one value fills the places, cast (torch 2.13)
            if (isinstance(source, torch.Tensor) and destination.is_floating_point()
                    and source.is_floating_point() and source.dtype != destination.dtype):
                raise PlanError(
                    f"precision={self.precision}: {_script_line()}: {name} writes a "
                    f"{_dtype(source)} source into a {_dtype(destination)} tensor, which "
                    f"torch refuses (autocast casts neither side of {name}): one side is "
                    "16-bit under the plan (the model's compute, or its parameters under "
                    "bf16), the other fp32 as the script made it (a torch.zeros/ones/full "
                    "without dtype=, a copy of the model made before prepare); make them "
                    "agree (dtype=..., source.to(destination.dtype)) or keep fp32")
        return func(*args, **kwargs)


def _advanced_index(index) -> bool:
    """``x[index] = v`` runs ``index_put_`` (which refuses another dtype) where the index
    holds a tensor with dimensions; slices, ints and 0-d tensors copy."""
    return any(isinstance(t, torch.Tensor) and t.dim() > 0 for t in tree_flatten(index)[0])


def _leave(mode: TorchFunctionMode) -> None:
    """Take ``mode`` off torch's function-mode stack wherever it is (the two watches end in
    another order than they began: the coupling one at the first backward, the dtype one
    at the second forward), the modes above it kept in their order."""
    from torch.overrides import _get_current_function_mode_stack, _pop_mode, _push_mode
    if not any(m is mode for m in _get_current_function_mode_stack()):
        return
    above = []
    while (top := _pop_mode()) is not mode:
        above.append(top)
    for other in reversed(above):
        _push_mode(other)


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).replace("torch.", "")


def watch_first_forward(module: torch.nn.Module, precision: str) -> None:
    """Run the module's first iteration under ``DtypeWatch`` (16-bit plans only): from its
    first forward to its second, so the loss, the step and what the script does after it
    (an EMA copy made before ``prepare`` lerped towards 16-bit parameters) are watched.
    The watch raises only where torch itself would, so its window costs time, not runs."""
    if precision not in ("amp-fp16", "amp-bf16", "bf16"):
        return
    state = {"mode": None, "forwards": 0}

    def enter(*_):
        if state["mode"] is None and not state["forwards"]:
            state["mode"] = DtypeWatch(precision)
            state["mode"].__enter__()
        elif state["forwards"] and state["mode"] is not None:  # the second iteration
            mode, state["mode"] = state["mode"], None
            pre.remove()
            post.remove()
            _leave(mode)

    def done(*_):
        state["forwards"] += 1

    pre = module.register_forward_pre_hook(enter)
    post = module.register_forward_hook(done, always_call=True)


def start_coupling_watch(values, first_part, parts: int, plan_text: str):
    """A ``CouplingWatch`` entered for the first micro-batch ``first_part`` of the batch
    ``values`` (None where the batch is not split or ``--allow-batch-coupling`` was
    given); ``end_coupling_watch`` leaves it."""
    from .batching import tensors_of
    if parts <= 1 or allowed_coupling():
        return None
    whole, part = tensors_of(values), tensors_of(first_part)
    sizes = next(((a.shape[d], b.shape[d]) for a, b in zip(whole, part) if a.dim() == b.dim()
                  for d in range(a.dim()) if a.shape[d] != b.shape[d]), None)
    if sizes is None:
        return None
    watch = CouplingWatch(part, int(sizes[1]), int(sizes[0]), plan_text)
    watch.__enter__()
    return watch


def end_coupling_watch(watch) -> None:
    if watch is not None:
        _leave(watch)
