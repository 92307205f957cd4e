"""Data parallelism and sharding with PyTorch's own wrappers.

==========  ======================================================================
shard       realised as
==========  ======================================================================
ddp         ``DistributedDataParallel``: every rank holds everything, gradients all-reduced
zero1       DDP + ``torch.distributed.optim.ZeroRedundancyOptimizer``: optimizer state
            sharded, each rank steps its share and broadcasts it (ZeRO stage 1 exactly)
zero2       FSDP2 ``fully_shard(reshard_after_forward=False)``: gradients reduce-scattered
            to shards and optimizer state sharded; parameters are gathered once per step
            and stay whole from forward through backward (ZeRO-2's peak)
zero3       FSDP2 ``fully_shard(reshard_after_forward=True)``: parameters sharded too and
            gathered per block in forward and again in backward
hybrid=G    zero2/zero3 on a 2-D mesh (replicate x shard) = HSDP; zero1 shards the
            optimizer inside process groups of G ranks
==========  ======================================================================

The process group is created here when the script did not: gloo on CPU, nccl on CUDA.
gloo groups get one worker thread, which zero2/zero3 and tp plans drain after each
collective, so its buffers are freed at the same point in every run (``gloo_release``).
"""
from __future__ import annotations

import inspect
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..plan import Plan, PlanError
from . import fsdp_params, gloo_release
from .ddp_wrapper import ModelFacingDDP


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0


def read_ranks() -> Ranks:
    """Where this process sits, from the variables torchrun sets (one process: rank 0 of 1)."""
    def number(name, default):
        try:
            return int(os.environ.get(name, default))
        except ValueError:
            return default
    return Ranks(number("RANK", 0), number("WORLD_SIZE", 1), number("LOCAL_RANK", 0))


def select_local_device() -> None:
    """Under torchrun make ``"cuda"`` mean this rank's GPU, before the script moves anything.

    Scripts say ``.to("cuda")``; with the current device set per rank that lands on GPU
    LOCAL_RANK instead of every rank crowding onto GPU 0.
    """
    if "LOCAL_RANK" in os.environ and torch.cuda.is_available():
        local = read_ranks().local_rank
        if local < torch.cuda.device_count():
            torch.cuda.set_device(local)


def init_process_group(device_type: str, ranks: Ranks) -> bool:
    """Join the job's process group unless the script did; returns whether we created it."""
    if ranks.world_size == 1 or dist.is_initialized():
        return False
    if device_type == "cuda":
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    else:
        gloo_release.create_groups_with_one_worker()
        dist.init_process_group("gloo")
    return True


def wrap_model(model: nn.Module, plan: Plan, device_type: str, blocks: list[str]) -> nn.Module:
    """The model the script should call from now on (a DDP wrapper, or ``model`` itself
    turned into an FSDP module in place)."""
    if device_type == "cpu" and (plan.uses_fsdp or plan.tp > 1) and plan.pp == 1:
        # collective buffers freed at one point every run, not when gloo's thread runs
        gloo_release.install_drain()
    if plan.shard in ("ddp", "zero1"):
        # ModelFacingDDP: the script's model.<attr> still works on what prepare returns
        device_ids = [torch.cuda.current_device()] if device_type == "cuda" else None
        return ModelFacingDDP(model, device_ids=device_ids, shard=plan.shard)
    if plan.uses_fsdp:
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard
        mesh = device_mesh(plan, device_type)
        reshard = plan.shard == "zero3"
        offload = CPUOffloadPolicy() if "params" in plan.offload else OffloadPolicy()
        ignored = prepare_for_fsdp(model, plan, mesh)
        modules = dict(model.named_modules())
        for path in blocks:  # one sharding unit per repeated block, then the rest at the root
            fully_shard(modules[path], mesh=mesh, reshard_after_forward=reshard,
                        offload_policy=offload, ignored_params=ignored)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard, offload_policy=offload,
                    ignored_params=ignored)
        return model
    return model


def prepare_for_fsdp(model: nn.Module, plan: Plan, mesh) -> set[nn.Parameter]:
    """Make the parameters fully_shard refuses acceptable (fsdp_params.py); returns the
    0-dim ones, kept whole beside the shards (``ignored_params``)."""
    contiguous = fsdp_params.make_contiguous(model)
    scalars = fsdp_params.scalar_parameters(model)
    fsdp_params.replicate_with_averaged_gradients(list(scalars.values()), mesh)
    notes = []
    if contiguous:
        notes.append(f"made {len(contiguous)} non-contiguous parameters contiguous (e.g. "
                     f"channels_last conv weights: {contiguous[0]}), as FSDP2 requires")
    if scalars:
        notes.append(f"kept {len(scalars)} 0-dim parameters ({', '.join(list(scalars)[:3])}) "
                     "whole on every rank, gradients averaged: FSDP2 cannot shard scalars")
    if notes and dist.get_rank() == 0:
        print(f"memadvisor: shard={plan.shard}: " + "; ".join(notes), file=sys.stderr,
              flush=True)
    return set(scalars.values())


def device_mesh(plan: Plan, device_type: str):
    from torch.distributed.device_mesh import init_device_mesh
    if plan.tp > 1:  # FSDP over the data-parallel dimension of the (dp, tp) mesh
        from .tensor_parallel import data_parallel_mesh
        return data_parallel_mesh(plan, device_type)
    if plan.hybrid:
        return init_device_mesh(device_type, (plan.world // plan.hybrid, plan.hybrid),
                                mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device_type, (plan.world,), mesh_dim_names=("shard",))


def optimizer_shard_group(plan: Plan):
    """zero1: the process group the optimizer state is sharded over (None = all ranks)."""
    if not plan.hybrid:
        return None
    size = plan.hybrid
    groups = [list(range(start, start + size)) for start in range(0, plan.world, size)]
    mine, _ = dist.new_subgroups_by_enumeration(groups)
    return mine


def check_world(plan: Plan, ranks: Ranks) -> None:
    if plan.world != ranks.world_size:
        if ranks.world_size == 1:
            raise PlanError(
                f"the plan runs on world={plan.world} ranks but this is a single process: "
                f"launch it with `memadvisor apply --nproc {plan.world}` or "
                f"`torchrun --nproc-per-node {plan.world}`")
        raise PlanError(f"the plan says world={plan.world} but {ranks.world_size} processes "
                        "were launched: make them equal")


def convert_batch_norm(model: nn.Module, plan: Plan, device_type: str) -> tuple[nn.Module, str]:
    """Batch statistics are what splitting the batch changes.  Across GPUs ``SyncBatchNorm``
    computes them over all ranks' slices, as the single process did; what cannot be kept
    (micro-batches, CPU ranks) comes back as a warning to print."""
    has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    if not has_bn:
        return model, ""
    why = []
    if plan.world > 1 and device_type == "cuda":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    elif plan.world > 1:
        why.append("SyncBatchNorm needs GPUs, so each rank normalises its own slice")
    if plan.accum > 1:
        why.append(f"accum={plan.accum} normalises each micro-batch separately")
    if not why:
        return model, ""
    return model, ("the model has BatchNorm layers and " + "; ".join(why) +
                   ": training is close to, not equal to, the unmodified run")


def watch_device(wrapped: nn.Module, plan: Plan, device_type: str) -> None:
    """Stop with a clear message where the script moves the model to another device after
    ``prepare`` wrapped it (``model.to("cuda")`` after a CPU model was sharded): FSDP's
    mesh and DDP's buckets stay on the device prepare saw, and the first collective would
    fail deep inside torch.  The rewrite puts prepare after such a move where it can
    (``ScriptFinder.device_move``); this catches the rest, at the first forward.  Devices
    are compared as sets, before and after: parameters FSDP offloads stay on the CPU."""
    if plan.world <= 1 or plan.pp > 1:
        return
    wrapped_on = {p.device.type for p in wrapped.parameters()}

    def check(module, args):
        handle.remove()
        now_on = {p.device.type for p in module.parameters()}
        if now_on != wrapped_on:
            raise PlanError(
                f"shard={plan.shard}: the model was moved to {', '.join(sorted(now_on))} "
                f"after mem.prepare wrapped it on {device_type}; move it to its device "
                "before the optimizer is built, or put mem.prepare after the move")

    handle = wrapped.register_forward_pre_hook(check, prepend=True)


def forward_methods(module: nn.Module, wrapped: nn.Module, plan: Plan, methods) -> None:
    """Make ``model.<method>(...)`` work on what prepare returns (VAE's ``decode``):
    FSDP2 gathers the parameters around methods registered with
    ``register_fsdp_forward_method``.  (The DDP wrapper, ``ModelFacingDDP``, forwards
    the model's attributes and methods itself, refusing what would miss the gradient
    sync.)"""
    if not plan.uses_fsdp:
        return
    for name in methods:
        attribute = inspect.getattr_static(type(module), name, None)
        if attribute is None or not callable(attribute):
            submodule = getattr(module, name, None)
            if isinstance(submodule, nn.Module):
                from torch.distributed.fsdp import FSDPModule
                if not isinstance(submodule, FSDPModule):
                    raise PlanError(
                        f"shard={plan.shard}: the script calls model.{name}(...) directly, a "
                        "submodule whose parameters are sharded with the model's and gathered "
                        "only inside model(...); call it through the model's forward")
            continue
        from torch.distributed.fsdp import register_fsdp_forward_method
        register_fsdp_forward_method(module, name)
