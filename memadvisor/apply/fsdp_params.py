"""Parameters FSDP2's ``fully_shard`` refuses, made shardable or kept out of it.

=======================  ==================================================================
parameter                what happens
=======================  ==================================================================
0-dim (``logit_scale``,  FSDP2 shards along dim 0 and refuses scalars.  They stay whole on
learnable temperature)   every rank (``ignored_params``): the script's own uses (``.exp()``,
                         ``clamp_``, printing) see the same 0-dim tensor, and their gradient
                         is averaged over the data-parallel ranks after each backward, as
                         FSDP's reduce-scatter averages the others: training is the
                         unmodified run's.  A 0-dim plain tensor beside DTensors is
                         implicitly replicated by DTensor's dispatch, so foreach optimizers
                         and ``clip_grad_norm_`` accept the mix.
non-contiguous           FSDP2 refuses them ("does not support non-contiguous parameters");
(channels_last convs,    made contiguous first.  FSDP2's gathered parameters are contiguous
transposed views)        anyway, and a conv keeps its output channels_last when its input
                         is, so only the kernel a GPU picks may change, not the math.
=======================  ==================================================================
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def make_contiguous(model: nn.Module) -> list[str]:
    """Make every non-contiguous parameter contiguous in place (same Parameter object, so
    names and the optimizer's references hold); returns their names."""
    changed = []
    for name, parameter in model.named_parameters():
        if not parameter.is_contiguous():
            parameter.data = parameter.data.contiguous()
            changed.append(name)
    return changed


def scalar_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The 0-dim parameters fully_shard cannot shard, by name."""
    return {name: p for name, p in model.named_parameters() if p.dim() == 0}


def replicate_with_averaged_gradients(parameters: list[nn.Parameter], mesh) -> None:
    """Keep ``parameters`` whole on every rank of ``mesh`` and average their gradients over
    it after each backward that reaches them.

    The average runs on every backward, also within gradient accumulation: the mean of
    an accumulated gradient whose earlier part is already the same on every rank adds
    only this backward's mean, so the result is the accumulated mean either way.
    """
    groups = [mesh.get_group(dim) for dim in range(mesh.ndim)]
    ranks = mesh.size()

    def average(parameter: torch.Tensor) -> None:
        for group in groups:  # summing over each mesh dimension in turn sums over all
            dist.all_reduce(parameter.grad, group=group)
        parameter.grad.div_(ranks)

    for parameter in parameters:
        parameter.register_post_accumulate_grad_hook(average)
        # a replicated parameter's full tensor is itself: checks.py counts parameters
        # without full_tensor as "not sharded", meaning missed by fully_shard
        parameter.full_tensor = parameter.detach
