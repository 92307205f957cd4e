"""The optimizer after prepare: the script's, rebuilt over new parameters, swapped, or sharded.

The script's optimizer is kept as it is whenever that is correct.  It is rebuilt (same
class, same per-group hyperparameters) when FSDP2 replaced the parameters with DTensor
shards, and replaced when the plan swaps the optimizer: ``lr`` and ``weight_decay`` of
every parameter group carry over, the rest takes the new optimizer's defaults.
"""
from __future__ import annotations

import importlib.util
import inspect

import torch

from ..plan import Plan, PlanError

#: hyperparameters a swapped-in optimizer inherits from each of the script's groups
_CARRIED = ("lr", "weight_decay")


def optimizer_spec(original: torch.optim.Optimizer, plan: Plan):
    """(class, defaults) of the optimizer the plan asks for."""
    kind = plan.optimizer
    if kind == "keep":
        cls = type(original)
        return cls, _constructor_arguments(cls, original.defaults)
    if kind == "sgd":
        return torch.optim.SGD, {"momentum": 0.0}
    if kind == "sgd-momentum":
        return torch.optim.SGD, {"momentum": 0.9}
    if kind == "adafactor":
        return torch.optim.Adafactor, {}
    if kind == "adam8bit":
        if importlib.util.find_spec("bitsandbytes") is None:
            raise PlanError("optimizer=adam8bit needs bitsandbytes: pip install bitsandbytes")
        import bitsandbytes as bnb
        decoupled = isinstance(original, torch.optim.AdamW)
        return (bnb.optim.AdamW8bit if decoupled else bnb.optim.Adam8bit), {}
    raise PlanError(f"unknown optimizer {kind!r}")


def param_groups(original: torch.optim.Optimizer, plan: Plan, new_params: dict,
                 names_by_id: dict[int, str]) -> list[dict]:
    """The script's groups over the parameters the model has now (matched by name)."""
    groups = []
    for group in original.param_groups:
        params = [new_params[names_by_id[id(p)]] for p in group["params"]]
        if plan.optimizer == "keep":
            settings = {k: v for k, v in group.items() if k != "params"}
        else:
            settings = {k: group[k] for k in _CARRIED if k in group}
        groups.append({"params": params, **settings})
    return groups


def needs_rebuild(plan: Plan) -> bool:
    # tp: parallelize_module registers new (DTensor) Parameters in place of the old ones
    return (plan.optimizer != "keep" or plan.uses_fsdp or plan.shard == "zero1"
            or "optimizer" in plan.offload or plan.tp > 1)


#: optimizers whose step treats every parameter as one flat vector (LBFGS's dot products and
#: ``grad.view(-1)``): sharded parameters (FSDP's DTensors) break it, and a sharded optimizer
#: (zero1) would compute its directions per shard, which is different math
WHOLE_VECTOR_OPTIMIZERS = (torch.optim.LBFGS,)


def check_shardable(original: torch.optim.Optimizer, plan: Plan) -> None:
    if plan.optimizer == "keep" and isinstance(original, WHOLE_VECTOR_OPTIMIZERS) and (
            plan.uses_fsdp or plan.shard == "zero1"):
        raise PlanError(f"shard={plan.shard}: {type(original).__name__} treats all parameters "
                        "as one vector (flattened gradients, dot products over the whole model), "
                        "which sharding parameters or optimizer state across ranks breaks; "
                        "use shard=ddp")


def check_rebuildable(original: torch.optim.Optimizer, plan: Plan) -> None:
    if needs_rebuild(plan) and any(original.state.values()):
        raise PlanError("the optimizer already has state (was a checkpoint loaded before "
                        "prepare?); the plan rebuilds the optimizer, so prepare must come "
                        "before the first step and before loading optimizer state")


def build_optimizer(original: torch.optim.Optimizer, plan: Plan, new_params: dict,
                    names_by_id: dict[int, str], shard_group=None) -> torch.optim.Optimizer:
    if not needs_rebuild(plan):
        return original
    check_rebuildable(original, plan)
    cls, defaults = optimizer_spec(original, plan)
    groups = param_groups(original, plan, new_params, names_by_id)
    if plan.shard == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        return ZeroRedundancyOptimizer(groups, optimizer_class=cls, process_group=shard_group,
                                       **defaults)
    if "optimizer" in plan.offload and not plan.uses_fsdp:
        from .offload import HostOptimizer
        return HostOptimizer(groups, cls, defaults)
    return construct(cls, groups, defaults)


def _constructor_arguments(cls, values: dict) -> dict:
    """The entries of ``values`` that ``cls(params, **kwargs)`` accepts (``defaults`` can hold
    more, e.g. AdamW's ``decoupled_weight_decay``)."""
    try:
        parameters = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(values)
    return {k: v for k, v in values.items() if k in parameters}


def construct(cls, groups, defaults):
    try:
        return cls(groups, **defaults)
    except TypeError:
        # an optimizer whose ``defaults`` are not all constructor arguments: the groups
        # already carry every hyperparameter
        return cls(groups)
