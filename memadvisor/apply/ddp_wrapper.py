"""The DistributedDataParallel wrapper ``prepare`` hands back in place of the script's model.

``prepare`` rebinds the script's ``model`` to the wrapper, so every later ``model.<name>``
must still mean what it meant: ``model.logit_scale.clamp_(...)``, ``model.config``,
``model.generate(...)``.  ``nn.Module.__getattr__`` only looks in the wrapper's own
parameters, buffers and submodules (the one submodule ``module``); what it cannot find is
looked up on the script's model here.  The wrapper's own attributes (``module``,
``no_sync``, ``state_dict`` with its ``module.`` keys, ...) are found first and unchanged.

DDP all-reduces gradients only for a backward prepared by its own forward
(``Reducer.prepare_for_backward`` in ``_post_forward``; the reducer's hooks ignore any other
backward).  A submodule or method reached through the wrapper (``model.encoder(x)``,
``model.encode_image(x)``) runs outside it: its gradients would stay per rank and the ranks
drift apart with exit 0.  So such a call that returns a tensor needing gradients, in
training mode, is refused with one line; without gradients (evaluation, ``generate`` under
``no_grad``, a frozen part) it runs.
"""
from __future__ import annotations

import functools

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..plan import PlanError

#: names DDP itself probes with hasattr: the script's model must not answer for them
_WRAPPER_PROBES = frozenset({"buffer_hook"})


class ModelFacingDDP(DistributedDataParallel):
    """DistributedDataParallel whose missing attributes are the wrapped model's."""

    def __init__(self, module: nn.Module, *args, shard: str = "ddp", **kwargs):
        super().__init__(module, *args, **kwargs)
        self.__dict__["_memadvisor_shard"] = shard
        self.__dict__["_memadvisor_forward_depth"] = 0
        self.__dict__["_memadvisor_guarded"] = set()  # ids of submodules given the guard hook

    def forward(self, *inputs, **kwargs):
        # calls of submodules inside the wrapper's forward are prepared for gradient sync
        self.__dict__["_memadvisor_forward_depth"] += 1
        try:
            return super().forward(*inputs, **kwargs)
        finally:
            self.__dict__["_memadvisor_forward_depth"] -= 1

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if (module is None or "_memadvisor_guarded" not in self.__dict__
                    or name in _WRAPPER_PROBES or (name.startswith("__") and name.endswith("__"))):
                raise
        value = getattr(module, name)  # a missing name raises the script's model's own error
        if isinstance(value, nn.Module):
            self._guard_submodule(name, value)
        elif callable(value) and getattr(value, "__self__", None) is module:
            return self._guarded_method(name, value)
        return value

    def __setattr__(self, name: str, value) -> None:
        # an attribute of the script's model is set there (model.temperature = ...), as the
        # script meant; the wrapper's own and new names stay on the wrapper
        module = self.__dict__.get("_modules", {}).get("module")
        if (module is not None and "_memadvisor_guarded" in self.__dict__
                and not self._owns(name) and hasattr(module, name)):
            setattr(module, name, value)
            return
        super().__setattr__(name, value)

    def _owns(self, name: str) -> bool:
        own = self.__dict__
        return (name in own or hasattr(type(self), name)
                or any(name in own.get(store, {}) for store in ("_parameters", "_buffers",
                                                                 "_modules")))

    def _outside_forward(self) -> bool:
        # a checkpointed region's recompute re-runs submodules inside the backward
        in_backward = torch._C._current_graph_task_id() != -1
        return not in_backward and self.__dict__["_memadvisor_forward_depth"] == 0

    def _refuse_if_differentiable(self, name: str, module: nn.Module, result) -> None:
        if (module.training and torch.is_grad_enabled() and self._outside_forward()
                and _needs_gradient(result)):
            shard = self.__dict__["_memadvisor_shard"]
            raise PlanError(
                f"shard={shard}: model.{name}(...) ran with gradients in training mode outside "
                "model(...); under DistributedDataParallel only model(...) all-reduces "
                "gradients: call it from the model's forward, or under torch.no_grad()")

    def _guard_submodule(self, name: str, submodule: nn.Module) -> None:
        guarded = self.__dict__["_memadvisor_guarded"]
        if id(submodule) in guarded:
            return
        guarded.add(id(submodule))

        def check(_module, _inputs, output):
            self._refuse_if_differentiable(name, submodule, output)
        submodule.register_forward_hook(check)

    def _guarded_method(self, name: str, method):
        module = self.__dict__["_modules"]["module"]

        @functools.wraps(method)
        def guarded(*args, **kwargs):
            depth = self.__dict__
            depth["_memadvisor_forward_depth"] += 1  # the submodules it calls: judged as one
            try:
                result = method(*args, **kwargs)
            finally:
                depth["_memadvisor_forward_depth"] -= 1
            self._refuse_if_differentiable(name, module, result)
            return result
        return guarded


def _needs_gradient(result) -> bool:
    """Does ``result`` (a tensor, or tensors in tuples, lists, dicts, dataclass-like
    outputs) hold a tensor autograd will backpropagate through?"""
    if isinstance(result, torch.Tensor):
        return result.requires_grad
    if isinstance(result, (list, tuple)):
        return any(_needs_gradient(item) for item in result)
    if isinstance(result, dict):
        return any(_needs_gradient(item) for item in result.values())
    fields = getattr(result, "__dict__", None)
    if isinstance(fields, dict) and not isinstance(result, nn.Module):
        return any(isinstance(v, torch.Tensor) and v.requires_grad for v in fields.values())
    return False
