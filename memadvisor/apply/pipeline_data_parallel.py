"""``pp=P,shard=ddp,world=P x D``: D pipelines side by side, each reading its own part of
the batch, every stage's gradients averaged over the D replicas of that stage.

The ranks form a ``DeviceMesh`` of shape (D, P) with dims ``("dp", "pp")``: consecutive
ranks are one pipeline (rank r is stage r % P of replica r // P, as consecutive ranks form
a tensor-parallel group under tp), and the ranks holding the same stage form its
data-parallel group.  Replica d takes the slice ``[d B / D, (d + 1) B / D)`` of the global
batch -- the rule of ``batching.split`` for D data-parallel ranks -- and its pipeline cuts
that slice into M micro-batches.  After the schedule each gradient on a rank is averaged
over its stage's data-parallel group (what DDP's all-reduce computes; not DDP itself, whose
reducer only syncs a backward its own forward prepared, and the schedule runs the stages'
backwards itself).

Under ``hybrid=G`` a stage's D replicas split as (D / G) x G: the mesh is (D / G, G, P) with
dims ``("dp_replicate", "dp_shard", "pp")`` and its two data-parallel dims flattened into
``dp`` (the D replicas, over which every gradient is still averaged).  zero2/zero3 shard
each stage over its G ranks and replicate over the D / G groups (FSDP2's HSDP on the 2-D
``(dp_replicate, dp_shard)`` mesh, as apply does without a pipeline); zero1's
ZeroRedundancyOptimizer shards the stage's optimizer state over the G ranks.  All groups
come from one root mesh, and each holds ranks of one stage (drained on gloo).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..plan import Plan, PlanError


@dataclass
class Groups:
    """This rank's process groups (None: the whole world, a pipeline alone)."""

    pipeline: object = None  #: the P ranks of this rank's pipeline (its stages)
    data_parallel: object = None  #: the D ranks holding this rank's stage(s)
    data_parallel_size: int = 1
    mesh: object = None
    tensor_parallel: object = None  #: the tp ranks splitting this rank's stage (under tp)
    #: under hybrid=G: the G ranks of this stage's replicas that share one copy of the
    #: sharded state (None: all D, ``data_parallel``)
    data_parallel_shard: object = None

    @property
    def shard_group(self):
        """The ranks zero1/zero2/zero3 shard this stage's state over."""
        return (self.data_parallel_shard if self.data_parallel_shard is not None
                else self.data_parallel)

    @property
    def sharding_mesh(self):
        """What FSDP2 shards a stage over: the ``dp`` dim, or under hybrid the 2-D
        ``(dp_replicate, dp_shard)`` mesh (HSDP: shard over G, replicate over D / G)."""
        if "dp_shard" in (self.mesh.mesh_dim_names or ()):
            return self.mesh["dp_replicate", "dp_shard"]
        return self.mesh["dp"]


def pipeline_rank(plan: Plan, rank: int) -> int:
    """This rank's place in its pipeline (its first stage under interleaved); under tp the
    tp ranks of one stage are consecutive (the (dp, pp, tp) mesh)."""
    return (rank // plan.tp) % plan.pp


def data_parallel_rank(plan: Plan, rank: int) -> int:
    """Which replica's slice of the batch ``rank`` takes."""
    return rank // (plan.pp * plan.tp)


def batch_split(plan: Plan, rank: int) -> tuple[Plan, int]:
    """(plan, rank) for ``batching.split`` under a pipeline: replica d's B / D samples, whole
    (the pipeline cuts them into its M micro-batches; a pipeline alone takes the batch)."""
    replicas = plan.data_parallel_size
    split = Plan(world=replicas, shard="ddp") if replicas > 1 else Plan()
    return split, data_parallel_rank(plan, rank)


def make_groups(plan: Plan, device_type: str) -> Groups:
    """The (dp, pp) mesh's groups; a pipeline alone keeps the world group; under tp the
    (dp, pp, tp) mesh tensor parallelism made (``tensor_parallel.make_mesh``)."""
    replicas = plan.data_parallel_size
    if plan.tp > 1:
        from .tensor_parallel import make_mesh
        mesh = make_mesh(plan, device_type)
        return Groups(mesh["pp"].get_group(),
                      mesh["dp"].get_group() if replicas > 1 else None, replicas, mesh,
                      mesh["tp"].get_group())
    if replicas == 1:
        return Groups()
    from torch.distributed.device_mesh import init_device_mesh

    if plan.hybrid:
        # dp index d = (replica group) x G + (shard rank): G consecutive replicas share one
        # copy of the stage's state, as hybrid's groups without a pipeline
        mesh = init_device_mesh(device_type, (replicas // plan.hybrid, plan.hybrid, plan.pp),
                                mesh_dim_names=("dp_replicate", "dp_shard", "pp"))
        every_replica = mesh["dp_replicate", "dp_shard"]._flatten("dp")
        return Groups(mesh["pp"].get_group(), every_replica.get_group(), replicas, mesh,
                      data_parallel_shard=mesh["dp_shard"].get_group())
    mesh = init_device_mesh(device_type, (replicas, plan.pp), mesh_dim_names=("dp", "pp"))
    return Groups(mesh["pp"].get_group(), mesh["dp"].get_group(), replicas, mesh)


def shard_blocks(module, blocks: list, plan: Plan, groups: Groups, optimizer) -> None:
    """zero2/zero3: FSDP2 ``fully_shard`` on each of this rank's blocks (``blocks``: the
    modules) over its stage's data-parallel group, so each replica holds 1/D of the stage's
    block parameters, gradients and optimizer state (1/G under hybrid: HSDP); the
    optimizer's groups take the sharded parameters (no state exists yet).  The layers
    outside the stack are the root unit, sharded too; their gradients (zero on the middle
    stages) are summed over the pipeline after the schedule, shard by shard."""
    from . import pipeline_collectives
    # the gradient norm sums FSDP's shards' squares over the ranks holding the other shards
    pipeline_collectives.data_parallel_shard_group = (
        groups.data_parallel_shard if plan.uses_fsdp else None)
    if not plan.uses_fsdp or groups.data_parallel_size == 1:
        return
    from torch.distributed.fsdp import fully_shard

    names = {id(p): n for n, p in module.named_parameters()}
    reshard = plan.shard == "zero3"
    for block in blocks:
        fully_shard(block, mesh=groups.sharding_mesh, reshard_after_forward=reshard)
    # the rest (embeddings, final norm, head; a tied weight once) as the root unit, as
    # apply's zero2/zero3 without a pipeline: only the end stages use it
    fully_shard(module, mesh=groups.sharding_mesh, reshard_after_forward=reshard)
    after = dict(module.named_parameters())
    for group in optimizer.param_groups:
        group["params"] = [after[names[id(p)]] for p in group["params"]]


def unsharded_optimizer_plan(plan: Plan) -> Plan:
    """The plan to build the optimizer by before a pipeline cuts the model: ``zero1``'s
    ZeroRedundancyOptimizer must partition the stage's parameters, not the model's, so it
    is built afterwards (``shard_optimizer``; hybrid's groups with it)."""
    if plan.pp > 1 and plan.shard == "zero1":
        return dataclasses.replace(plan, shard="ddp", hybrid=None)
    return plan


def shard_optimizer(optimizer, original, plan: Plan, groups: Groups):
    """``zero1``: the optimizer over this rank's stage (its groups already cut) rebuilt as a
    ZeroRedundancyOptimizer over the stage's data-parallel replicas (its G-rank shard group
    under hybrid): each steps its share of the stage's parameters and broadcasts them (the
    gradients were averaged in place over all D replicas after the schedule,
    ``average_gradients``, so every shard group steps the same parameters)."""
    if plan.shard != "zero1" or plan.pp <= 1:
        return optimizer
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from .optimizers import optimizer_spec
    cls, defaults = optimizer_spec(original, plan)
    param_groups = [dict(group) for group in optimizer.param_groups if group["params"]]
    return ZeroRedundancyOptimizer(param_groups, optimizer_class=cls,
                                   process_group=groups.shard_group, **defaults)


def average_gradients(parameters, plan: Plan, groups: Groups) -> None:
    """Each gradient averaged over this stage's data-parallel replicas, in place (FSDP's
    sharded ones were averaged by its reduce-scatter; tensor parallelism's DTensors without
    FSDP are averaged here, their local part)."""
    if groups.data_parallel_size == 1:
        return
    for p in parameters:
        grad = p.grad
        if grad is None or (plan.uses_fsdp and hasattr(grad, "to_local")):
            continue
        grad = grad.to_local() if hasattr(grad, "to_local") else grad
        dist.all_reduce(grad, group=groups.data_parallel)
        grad.div_(groups.data_parallel_size)


def check_batch(plan: Plan, groups: Groups, batch_size: int, values: list,
                first: bool) -> None:
    """PlanError unless M divides this replica's batch and, with data parallelism, the
    ranks of this pipeline hold the same batch (checked on the ``first`` batch)."""
    m = plan.pipeline_microbatches
    replicas = groups.data_parallel_size
    if batch_size % m or batch_size < m:
        whose = f"each of the {replicas} replicas' part" if replicas > 1 else "the batch"
        raise PlanError(f"pp={plan.pp}: {whose} ({batch_size} samples) cannot be cut into {m} "
                        f"pipeline micro-batches: the batch must be a multiple of "
                        f"{m * replicas}")
    if replicas > 1 and first:
        tensors = [v for v in values if isinstance(v, torch.Tensor)]
        if not same_batch_in_pipeline(tensors, groups):
            raise PlanError(
                f"pp={plan.pp} with {replicas} data-parallel replicas: the ranks of one "
                "pipeline were handed different batches (the micro_batches split must give "
                "a replica's ranks its slice: pipeline_data_parallel.batch_split)")


def same_batch_in_pipeline(tensors: list[torch.Tensor], groups: Groups) -> bool:
    """Whether every rank of this pipeline got the same batch (a sum and the shape of each
    tensor compared): stage 0 reads the inputs, the last stage the targets, so a replica's
    ranks must hold one slice."""
    summary = []
    for t in tensors:
        summary += [float(t.detach().double().sum()) if t.numel() else 0.0,
                    float(t.shape[0])]
    mine = torch.tensor(summary, dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size(groups.pipeline))]
    dist.all_gather(every, mine, group=groups.pipeline)
    return all(torch.equal(e, mine) for e in every)
