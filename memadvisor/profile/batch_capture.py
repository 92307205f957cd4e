"""What the batch of a training step is, seen from the root module calls of that step.

The batch is what the script feeds (positionally or by keyword, nested in lists, tuples,
dicts, packed sequences) to the root module whose forward ran with gradients on and with
trainable parameters, before a backward: a module without trainable parameters (a
torchvision ``Normalize``, a loss module, a frozen teacher) or a forward under ``no_grad``
(evaluation between LBFGS steps) is not the model being trained.  Which dimension of each
tensor is the batch is decided by ``batch_layout.infer_layout`` from the shapes, from the
layout the model's own sequence modules declare (``batch_first``) and from the sizes that
changed between steps (sequence lengths).
"""
from __future__ import annotations

import sys

import torch

from .batch_layout import BatchLayout, infer_layout, layout_batch_size

from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.conv import _ConvNd
from torch.nn.modules.loss import _Loss

#: modules whose input layout torch documents: (T, B, C) or batch_first (B, T, C)
_SEQUENCE_MODULES = (torch.nn.RNNBase, torch.nn.MultiheadAttention, torch.nn.Transformer,
                     torch.nn.TransformerEncoderLayer, torch.nn.TransformerDecoderLayer)
#: (B, C) cells; (B, C, *spatial) convolutions and normalisations
_CELL_MODULES = (torch.nn.RNNCellBase,)
_CHANNEL_MODULES = (_ConvNd, _BatchNorm, torch.nn.GroupNorm)


def named_tensors(args, kwargs) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor in a call's arguments: ``args[0]``,
    ``input_ids``, ``args[1][0]``, ``batch.labels``; parameters are not data."""
    found: list[tuple[str, torch.Tensor]] = []
    pending = [(f"args[{i}]", value) for i, value in enumerate(args)]
    pending += list((kwargs or {}).items())
    pending.reverse()
    while pending:
        name, value = pending.pop()
        if isinstance(value, torch.nn.Parameter):
            continue
        if isinstance(value, torch.Tensor):
            found.append((name, value))
        elif isinstance(value, tuple) and hasattr(value, "_fields"):  # PackedSequence
            pending.extend(reversed([(f"{name}.{k}", v) for k, v in zip(value._fields, value)]))
        elif isinstance(value, (list, tuple)):
            pending.extend(reversed([(f"{name}[{i}]", v) for i, v in enumerate(value)]))
        elif isinstance(value, dict):
            pending.extend(reversed([(f"{name}.{k}", v) for k, v in value.items()]))
    return found


def call_kwargs(module: torch.nn.Module) -> dict:
    """The keyword arguments of the module call a global forward pre-hook is running for.

    torch's global pre-hooks get ``(module, args)`` only (``with_kwargs`` exists for a
    module's own hooks, which cannot be registered in time for a root's first call); the
    keywords are the ``kwargs`` of ``Module._call_impl``'s frame below the hook.  Empty
    when that frame is not found."""
    frame = sys._getframe(1)
    for _ in range(8):
        if frame is None:
            break
        local = frame.f_locals if frame.f_code.co_name in ("inner", "_call_impl") else None
        if local is not None and local.get("self") is module:
            kwargs = local.get("kwargs")
            return kwargs if isinstance(kwargs, dict) else {}
        frame = frame.f_back
    return {}


class BatchObserver:
    """Candidate batches per root call.  The root module whose call feeds the first backward
    is the model; each step's batch is its call before the step's first backward."""

    def __init__(self):
        self._candidate: dict | None = None  # the first training root call since a backward
        self._model: int | None = None  # id of the root module the first backward trained
        self._layout_sizes: set[int] = set()
        self._input_ids: dict[int, int] = {}  # id -> index of the candidate's tensors
        self._feature_inputs: set[int] = set()  # indices of inputs fed to a Linear as is
        self._chosen: dict | None = None  # this step's batch (first backward's)
        self._previous: dict | None = None  # an earlier step's, to see sizes that vary
        self._varying: set[int] = set()
        self.batch: dict = {}  #: what meta.batch says (latest step's)

    # --- events --------------------------------------------------------------------------
    def root_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if self._candidate is not None or not torch.is_grad_enabled():
            return
        if self._model is not None and id(module) != self._model:
            return  # another network (a GAN's generator before its discriminator's backward)
        if not any(p.requires_grad for p in module.parameters()):
            return  # a transform, a loss module, a frozen network: not the model trained
        tensors = named_tensors(args, kwargs)
        if tensors:
            self._input_ids = {id(t): index for index, (_, t) in enumerate(tensors)}
            self._feature_inputs = set()
            self._candidate = {"module": id(module), "names": [n for n, _ in tensors],
                               "shapes": [list(t.shape) for _, t in tensors],
                               "dtypes": [str(t.dtype).removeprefix("torch.")
                                          for _, t in tensors]}
            self._layout_sizes = set()

    def module_called(self, module: torch.nn.Module, args: tuple) -> None:
        """A layout-aware module inside the forward: its input tells the batch size."""
        if self._candidate is None or self._chosen is not None or not args:
            return
        shape = getattr(args[0], "shape", None)
        if shape is None:
            return
        if isinstance(module, torch.nn.Linear) and id(args[0]) in self._input_ids and shape:
            # an input fed to a Linear as it came: its last dimension is features
            self._feature_inputs.add(self._input_ids[id(args[0])])
            return
        if isinstance(module, _SEQUENCE_MODULES):
            size = layout_batch_size("sequence", bool(getattr(module, "batch_first", False)),
                                     shape)
        elif isinstance(module, _CELL_MODULES):
            size = layout_batch_size("cell", True, shape)
        elif isinstance(module, _CHANNEL_MODULES):
            # a convolution over k spatial dimensions is batched at k + 2 dimensions
            spatial = len(getattr(module, "kernel_size", ())) or len(shape) - 2
            size = int(shape[0]) if len(shape) == spatial + 2 and len(shape) >= 2 else None
        elif isinstance(module, _Loss) and len(args) > 1:
            # a loss module's target: one row per sample (a flattened (T*B,) target of a
            # sequence batch matches no input size and says nothing)
            target_shape = getattr(args[1], "shape", None)
            size = int(target_shape[0]) if target_shape else None
        else:
            return
        if size is not None:
            self._layout_sizes.add(size)

    def backward_begins(self) -> None:
        if self._chosen is None and self._candidate is not None:
            self._model = self._candidate["module"]
            self._chosen = dict(self._candidate, layout_sizes=sorted(self._layout_sizes),
                                feature_inputs=sorted(self._feature_inputs))
            self._update()
        self._candidate = None

    def step_ends(self) -> None:
        if self._chosen is not None:
            self._previous = self._chosen
        self._chosen = None
        self._candidate = None

    # --- the answer ----------------------------------------------------------------------
    def _update(self) -> None:
        chosen = self._chosen
        previous = self._previous
        if previous is not None and previous["names"] == chosen["names"]:
            for before, now in zip(previous["shapes"], chosen["shapes"]):
                if len(before) == len(now):
                    self._varying |= {s for pair in zip(before, now) if pair[0] != pair[1]
                                      for s in pair}
        shapes = [tuple(s) for s in chosen["shapes"]]
        layout = infer_layout(shapes, layout_sizes=chosen["layout_sizes"],
                              varying_sizes=self._varying)
        if layout.ambiguous and chosen["feature_inputs"]:
            # to break a tie only: the batch is in a dimension before the features
            possible = set.intersection(*(set(shapes[i][:-1]) for i in chosen["feature_inputs"]))
            features = {size for shape in shapes for size in shape} - possible
            untied = infer_layout(shapes, layout_sizes=chosen["layout_sizes"],
                                  varying_sizes=self._varying | features)
            if not untied.ambiguous:
                layout = BatchLayout(untied.batch_size, untied.dims,
                                     "the size left once the features a Linear reads of an "
                                     "input are set aside")
        if layout.ambiguous:
            # nothing tells [T, B] from [B, T]: dimension 0 of the first input, as most
            # scripts are batch-first, and the meta says so
            sizes = sorted({layout.batch_size, *layout.rivals})
            first = shapes[0]
            fallback = infer_layout(shapes, layout_sizes=[first[0]] if first else [],
                                    preferred_dims=[0] * len(shapes))
            layout = BatchLayout(fallback.batch_size, fallback.dims,
                                 f"ambiguous between sizes {sizes}: dimension 0 of the first "
                                 f"input taken")
        self.batch = {"batch_size": layout.batch_size, "shapes": chosen["shapes"],
                      "dtypes": chosen["dtypes"], "names": chosen["names"],
                      "batch_dims": list(layout.dims), "evidence": layout.evidence}
