"""``pp=P``: the gradients of earlier pipeline calls set aside around a schedule, and what
every stage computes together for the runtime: the full parameters gathered from the
stages, and the gradient norm over all of them."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from ..plan import PlanError

#: this rank's pipeline, data-parallel and tensor-parallel groups (apply_pipeline sets
#: them; None: the world for the pipeline, none for the others), over which the squared
#: gradient norms are summed
pipeline_group = None
data_parallel_group = None
tensor_parallel_group = None
#: under hybrid=G with zero2/zero3: the G ranks FSDP shards a stage over (its ``dp_shard``
#: dim; the ``dp_replicate`` dim holds copies), over which the shards' squares are summed
#: (``pipeline_data_parallel.shard_blocks`` sets it; None: the data-parallel group)
data_parallel_shard_group = None


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


#: the slots of the squared-norm vector: (whose, the mesh dimensions the gradient is split
#: over) -- a stage's own blocks or the layers every stage holds; FSDP splits over ``dp``
#: (``dp_shard`` under hybrid), tensor parallelism over ``tp``.  Fixed, so every rank makes
#: the same collectives.
_SLOTS = [(whose, split) for whose in ("own", "shared")
          for split in ((), ("dp",), ("tp",), ("dp", "tp"))]


#: mesh dim name -> the slot's name: hybrid's shard dim is FSDP's ``dp``
_SPLIT_SLOT = {"dp": "dp", "dp_shard": "dp", "tp": "tp"}


def _split_dims(grad) -> tuple[str, ...]:
    """The mesh dimensions a DTensor gradient is sharded over (its other dimensions hold
    copies); () for a plain tensor."""
    if not hasattr(grad, "placements"):
        return ()
    names = grad.device_mesh.mesh_dim_names or ()
    dims = {_SPLIT_SLOT.get(names[i]) for i, placement in enumerate(grad.placements)
            if placement.is_shard()}
    return tuple(d for d in ("dp", "tp") if d in dims)



def _sum_over(vector: torch.Tensor, slots: list[bool], group) -> None:
    """Sum the ``slots`` of ``vector`` over ``group``'s ranks, in place."""
    mask = torch.tensor(slots, dtype=vector.dtype)
    part = vector * mask
    dist.all_reduce(part, group=group)
    vector.mul_(1 - mask).add_(part)


def clip_grad_norm_(parameters, max_norm: float, replicated: set[int],
                    norm_type: float = 2.0, error_if_nonfinite: bool = False, foreach=None):
    """The total gradient norm over all stages: each stage's own blocks' squares summed over
    the pipeline, the replicated layers' (``replicated``: ids; equal on every rank after the
    gradient sum) counted once, shards (FSDP's over the replicas, tensor parallelism's over
    the tp group) summed over the ranks holding the other shards; every gradient scaled as
    torch's clip_grad_norm_ would."""
    if float(norm_type) != 2.0:
        raise PlanError(f"pp: clip_grad_norm_ with norm_type={norm_type} is not supported "
                        "under a pipeline yet (2.0 is)")
    params = [p for p in parameters if p.grad is not None]
    squares = torch.zeros(len(_SLOTS), dtype=torch.float32)
    for p in params:
        grad = p.grad.detach()
        split = _split_dims(grad)
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        whose = "shared" if id(p) in replicated else "own"
        squares[_SLOTS.index((whose, split))] += local.float().pow(2).sum().cpu()
    _sum_over(squares, [whose == "own" for whose, _ in _SLOTS], pipeline_group)
    fsdp_group = (data_parallel_shard_group if data_parallel_shard_group is not None
                  else data_parallel_group)
    for dim, group in (("dp", fsdp_group), ("tp", tensor_parallel_group)):
        if group is not None:
            _sum_over(squares, [dim in split for _, split in _SLOTS], group)
    total = squares.sum().sqrt()
    if error_if_nonfinite and not math.isfinite(float(total)):
        raise RuntimeError(f"the total norm of order 2.0 for gradients is {float(total)}")
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        grad = p.grad.detach()
        grad = grad.to_local() if hasattr(grad, "to_local") else grad
        grad.mul_(coefficient.to(grad.device, grad.dtype))
    return total


def align_gradient_layouts(module: nn.Module) -> None:
    """Each DTensor gradient laid out as its parameter, in place.  Under tp the embedding's
    backward gives its vocabulary-split weight a replicated gradient (the whole table) where
    the tied head gives a split one: the stages would then sum tensors of different shapes
    over the pipeline.  Replicate -> Shard keeps this rank's rows, no communication."""
    for p in module.parameters():
        grad = p.grad
        if (hasattr(grad, "placements") and hasattr(p, "placements")
                and tuple(grad.placements) != tuple(p.placements)):
            p.grad = grad.redistribute(p.device_mesh, p.placements)


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
