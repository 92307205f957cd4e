"""``pp=P``: the gradients of earlier pipeline calls set aside around a schedule, and what
every stage computes together for the runtime: the full parameters gathered from the
stages, and the gradient norm over all of them."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from ..plan import PlanError

#: this rank's pipeline and data-parallel groups (apply_pipeline sets them; None: the
#: world), over which the squared gradient norms are summed
pipeline_group = None
data_parallel_group = None


def full_parameters(module: nn.Module, parameter_names: list[str]) -> dict[str, torch.Tensor]:
    """Every parameter whole, on the CPU, by name: each stage's blocks gathered from the rank
    that holds them (a collective: every rank calls it)."""
    local = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone()
             for n, p in module.named_parameters()}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, local)
    merged: dict[str, torch.Tensor] = {}
    for part in every:
        for name, value in part.items():
            merged.setdefault(name, value)
    return {name: merged[name] for name in parameter_names}


def clip_grad_norm_(parameters, max_norm: float, replicated: set[int],
                    norm_type: float = 2.0, error_if_nonfinite: bool = False, foreach=None):
    """The total gradient norm over all stages: each stage's own blocks' squares summed over
    the pipeline, the replicated layers' (``replicated``: ids; equal on every rank after the
    gradient sum) counted once, FSDP's shards summed over their replicas too; every
    gradient scaled as torch's clip_grad_norm_ would."""
    if float(norm_type) != 2.0:
        raise PlanError(f"pp: clip_grad_norm_ with norm_type={norm_type} is not supported "
                        "under a pipeline yet (2.0 is)")
    params = [p for p in parameters if p.grad is not None]
    # squares by where they are summed: a stage's blocks over its pipeline (replicas hold
    # equal gradients) or, sharded by FSDP, over the world; the replicated layers' once,
    # or, sharded, over the replicas
    sums = {key: torch.zeros((), dtype=torch.float32)
            for key in ("own", "own_sharded", "shared", "shared_sharded")}
    for p in params:
        grad = p.grad.detach()
        sharded = hasattr(grad, "to_local")
        grad = grad.to_local() if sharded else grad
        key = ("shared" if id(p) in replicated else "own") + ("_sharded" if sharded else "")
        sums[key] += grad.float().pow(2).sum().cpu()
    dist.all_reduce(sums["own"], group=pipeline_group)
    dist.all_reduce(sums["own_sharded"])
    if data_parallel_group is not None:
        dist.all_reduce(sums["shared_sharded"], group=data_parallel_group)
    own = sums["own"] + sums["own_sharded"]
    shared = sums["shared"] + sums["shared_sharded"]
    total = (own + shared).sqrt()
    if error_if_nonfinite and not math.isfinite(float(total)):
        raise RuntimeError(f"the total norm of order 2.0 for gradients is {float(total)}")
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        grad = p.grad.detach()
        grad = grad.to_local() if hasattr(grad, "to_local") else grad
        grad.mul_(coefficient.to(grad.device, grad.dtype))
    return total


def set_aside_gradients(module: nn.Module) -> dict[int, torch.Tensor]:
    """The gradients from earlier pipeline calls of this optimizer step (a script that
    accumulates itself: nanoGPT's ``gradient_accumulation_steps``), by parameter id,
    taken off the parameters: the step divides every gradient of the stage by M, and the
    replicated layers' were summed over the stages already; only this call's part may be."""
    earlier = {}
    for p in module.parameters():
        if p.grad is not None:
            earlier[id(p)] = p.grad
            p.grad = None
    return earlier
