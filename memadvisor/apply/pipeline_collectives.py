"""``pp=P``: what every stage computes together after the schedule, for the runtime: the full
parameters gathered from the stages, and the gradient norm over all of them."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from ..plan import PlanError

#: the pipeline's process group (apply_pipeline sets it; None: the world, a pipeline
#: alone): the stages' gradient norms are summed over it, not over data-parallel replicas
pipeline_group = None


def full_parameters(module: nn.Module, parameter_names: list[str]) -> dict[str, torch.Tensor]:
    """Every parameter whole, on the CPU, by name: each stage's blocks gathered from the rank
    that holds them (a collective: every rank calls it)."""
    local = {n: p.detach().cpu().clone() for n, p in module.named_parameters()}
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
    the ranks, the replicated layers' (``replicated``: ids; equal on every rank after the
    gradient sum) counted once; every gradient scaled as torch's clip_grad_norm_ would."""
    if float(norm_type) != 2.0:
        raise PlanError(f"pp: clip_grad_norm_ with norm_type={norm_type} is not supported "
                        "under a pipeline yet (2.0 is)")
    params = [p for p in parameters if p.grad is not None]
    own = torch.zeros((), dtype=torch.float32)
    shared = torch.zeros((), dtype=torch.float32)
    for p in params:
        square = p.grad.detach().float().pow(2).sum().cpu()
        if id(p) in replicated:
            shared += square
        else:
            own += square
    dist.all_reduce(own, group=pipeline_group)
    total = (own + shared).sqrt()
    if error_if_nonfinite and not math.isfinite(float(total)):
        raise RuntimeError(f"the total norm of order 2.0 for gradients is {float(total)}")
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        p.grad.detach().mul_(coefficient.to(p.grad.device, p.grad.dtype))
    return total
