"""The calls a rewritten script makes: prepare, micro_batches, backward, step, clip_grad_norm_.

One process trains one model with one optimizer, so the runtime keeps one ``Session``
(module state, like ``torch.distributed``'s default group).  Without ``prepare`` every
call does what the unmodified script did.
"""
from __future__ import annotations

import atexit
import contextlib
import gc
import importlib.util
import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn

from ..plan import Environment, Plan, PlanError, environment_problems, repeated_blocks
from . import batching, checkpointing, optimizers, precision, sharding

_session: "Session | None" = None
_owns_process_group = False


class Session:
    def __init__(self, plan: Plan, module: nn.Module, model: nn.Module,
                 optimizer: torch.optim.Optimizer, ranks: sharding.Ranks,
                 parameter_names: list[str], scaler, checkpointed: list[str]):
        self.plan = plan
        self.module = module  #: the unwrapped model (FSDP modules are changed in place)
        self.model = model  #: what the script calls (a DDP wrapper or ``module``)
        self.optimizer = optimizer
        self.ranks = ranks
        self.parameter_names = parameter_names  #: in the script's optimizer order
        self.scaler = scaler
        self.checkpointed = checkpointed
        self.micro_batches_per_step = 1
        self.unscaled = False  #: GradScaler.unscale_ already ran since the last step

    def loss_weight(self) -> float:
        return 1.0 / self.micro_batches_per_step

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, on the CPU, by name, in the script's optimizer order
        (a collective under FSDP: every rank must call it)."""
        params = dict(self.module.named_parameters())
        result = {}
        for name in self.parameter_names:
            value = params[name].detach()
            if hasattr(value, "full_tensor"):
                value = value.full_tensor()
            result[name] = value.cpu().clone()
        return result


def _environment(device_type: str) -> Environment:
    cuda = device_type == "cuda"
    return Environment(
        device_type=device_type,
        bf16_supported=torch.cuda.is_bf16_supported() if cuda else True,
        fp16_supported=cuda,
        bitsandbytes_available=importlib.util.find_spec("bitsandbytes") is not None,
    )


def prepare(model: nn.Module, optimizer: torch.optim.Optimizer, plan: Plan | str = "none"):
    """Apply ``plan`` to the model and optimizer; returns the pair the script should use."""
    global _session, _owns_process_group
    plan = plan if isinstance(plan, Plan) else Plan.parse(plan)
    if not isinstance(model, nn.Module):
        raise PlanError(f"prepare expects an nn.Module as the model, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise PlanError("prepare expects a torch.optim optimizer, got "
                        f"{type(optimizer).__name__}")
    ranks = sharding.read_ranks()
    sharding.check_world(plan, ranks)
    first = next(model.parameters(), None)
    device_type = first.device.type if first is not None else "cpu"
    problems = environment_problems(plan, _environment(device_type))
    if problems:
        raise PlanError(problems[0])

    names_by_id = {id(p): name for name, p in model.named_parameters()}
    missing = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in names_by_id]
    if missing:
        raise PlanError(f"the optimizer holds {len(missing)} tensors that are not parameters "
                        "of the model given to prepare")
    parameter_names = [names_by_id[id(p)] for g in optimizer.param_groups for p in g["params"]]
    optimizers.check_rebuildable(optimizer, plan)

    if sharding.init_process_group(device_type, ranks):
        _owns_process_group = True
        atexit.register(finish)
    module, warning = sharding.convert_batch_norm(model, plan, device_type)
    if warning and ranks.rank == 0:
        warnings.warn(f"memadvisor: {warning}", stacklevel=2)
    precision.cast_parameters(module, plan)
    checkpointed = checkpointing.apply_checkpointing(module, plan)
    precision.wrap_forward(module, plan, device_type)
    blocks = repeated_blocks(checkpointing.module_entries(module)) if plan.uses_fsdp else []
    wrapped = sharding.wrap_model(module, plan, device_type, blocks)

    new_params = dict(module.named_parameters())
    shard_group = sharding.optimizer_shard_group(plan) if plan.shard == "zero1" else None
    new_optimizer = optimizers.build_optimizer(optimizer, plan, new_params, names_by_id,
                                               shard_group)
    _session = Session(plan, module, wrapped, new_optimizer, ranks, parameter_names,
                       precision.make_grad_scaler(plan, device_type), checkpointed)
    if ranks.rank == 0:
        print(f"memadvisor: {_describe(_session, device_type, blocks)}", file=sys.stderr,
              flush=True)
    return wrapped, new_optimizer


def _describe(session: Session, device_type: str, blocks: list[str]) -> str:
    """One line saying what prepare did, so a run's log shows the plan it ran."""
    plan = session.plan
    parts = [f"plan {plan} on {device_type}"]
    if plan.world > 1:
        parts[0] += f" x {plan.world} ranks"
    if session.checkpointed:
        paths = [p or "<model>" for p in session.checkpointed]
        shown = ", ".join(paths[:3]) + (f", ... ({len(paths)})" if len(paths) > 3 else "")
        parts.append(f"checkpointing {shown}")
    if plan.uses_fsdp:
        parts.append(f"fully_shard on {len(blocks)} blocks + the root")
    parts.append(f"optimizer {type(session.optimizer).__name__}")
    return "; ".join(parts)


def current_session() -> Session | None:
    return _session


def micro_batches(*values, batch_dims=None):
    """This rank's micro-batches of the batch ``values``: a tuple per micro-batch, or the
    value itself when one value is given.  Each tensor is cut along its own batch dimension
    (batching.py: sequence-first tensors along dimension 1, shared masks not at all);
    ``batch_dims`` (one entry per tensor, None = shared) settles layouts the shapes cannot.
    Under DDP every micro-batch but the last runs in ``no_sync`` (gradients are
    all-reduced once per step)."""
    session = _session
    if session is None:
        yield values if len(values) != 1 else values[0]
        return
    plan = session.plan
    no_sync = getattr(session.model, "no_sync", None)  # DDP (ddp, zero1)
    # the batch dims decided for the first batch, reused where a later one is ambiguous
    decided = getattr(session, "decided_batch_dims", None)
    if decided is None:
        decided = session.decided_batch_dims = {}
    session.micro_batches_per_step = plan.accum
    try:
        for index, part in enumerate(batching.split(
                values, plan, session.ranks.rank, model=session.model, batch_dims=batch_dims,
                decided=decided)):
            last = index == plan.accum - 1
            with (no_sync() if no_sync is not None and not last else contextlib.nullcontext()):
                yield part if len(values) != 1 else part[0]
    finally:
        session.micro_batches_per_step = 1


def backward(loss: torch.Tensor, **kwargs) -> None:
    """``loss.backward()``, scaled by 1/accum (and by the fp16 loss scale under amp-fp16)."""
    session = _session
    if session is None:
        loss.backward(**kwargs)
        return
    weight = session.loss_weight()
    if weight != 1.0:
        loss = loss * weight
    if session.scaler is not None:
        loss = session.scaler.scale(loss)
    loss.backward(**kwargs)


def step(optimizer: torch.optim.Optimizer, *args, **kwargs):
    """``optimizer.step()``; under amp-fp16 through the gradient scaler."""
    session = _session
    if session is None or session.scaler is None:
        return optimizer.step(*args, **kwargs)
    result = session.scaler.step(optimizer, *args, **kwargs)
    session.scaler.update()
    session.unscaled = False
    return result


def _unscale() -> None:
    session = _session
    if session is not None and session.scaler is not None and not session.unscaled:
        session.scaler.unscale_(session.optimizer)
        session.unscaled = True


def clip_grad_norm_(parameters, max_norm, *args, **kwargs) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` on true-scale gradients; the norm as a plain tensor
    (FSDP2 returns a DTensor)."""
    parameters = list(parameters) if not isinstance(parameters, torch.Tensor) else parameters
    _unscale()
    norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm, *args, **kwargs)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def clip_grad_value_(parameters, clip_value, *args, **kwargs):
    parameters = list(parameters) if not isinstance(parameters, torch.Tensor) else parameters
    _unscale()
    return torch.nn.utils.clip_grad_value_(parameters, clip_value, *args, **kwargs)


def unwrap(model: nn.Module) -> nn.Module:
    """The script's own model behind a DistributedDataParallel wrapper."""
    return getattr(model, "module", model) if isinstance(
        model, nn.parallel.DistributedDataParallel) else model


def finish(save_parameters: str | None = None, destroy_process_group: bool = True) -> None:
    """End the session: optionally save the full parameters (rank 0 writes), then leave the
    process group if prepare created it."""
    global _session, _owns_process_group
    session, _session = _session, None
    if session is not None and save_parameters:
        params = session.full_parameters()
        if session.ranks.rank == 0:
            torch.save({"plan": str(session.plan), "names": list(params),
                        "tensors": list(params.values())}, save_parameters)
    del session
    if destroy_process_group and _owns_process_group and dist.is_initialized():
        # DDP and ZeroRedundancyOptimizer objects still alive when the group goes away
        # can abort the process at exit ("terminate called without an active exception")
        gc.collect()
        dist.destroy_process_group()
        _owns_process_group = False
