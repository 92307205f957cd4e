"""``pp=P``: the ``PipelineStage`` objects of one rank and the torch schedule that runs them
(``Schedule1F1B``, ``ScheduleGPipe``, ``ScheduleInterleaved1F1B``), and the line a run's log
shows for them."""
from __future__ import annotations

import torch
from torch import nn

from ..plan import Plan


def identity_loss(output, target):
    """The schedule's loss function: the last stage's output is the loss already (the
    model's own, or the script's loss function run inside the stage's forward)."""
    return output


def build_schedule(plan: Plan, submodules: list[tuple[int, nn.Module]], meta: torch.Tensor,
                   device: torch.device, group=None):
    """A ``PipelineStage`` per (global stage index, module) this rank holds and the plan's
    schedule over them; ``meta``: one micro-batch's stream (shape, dtype, requires_grad).
    ``group``: the pipeline's process group (None: the world)."""
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                              ScheduleInterleaved1F1B)

    num_stages = plan.pipeline_stages
    stages = []
    for stage_index, submodule in submodules:
        is_last = stage_index == num_stages - 1
        stages.append(PipelineStage(
            submodule, stage_index, num_stages, device,
            input_args=(meta,) if stage_index > 0 else (),
            output_args=(meta,) if not is_last else (
                torch.empty((), device=device, requires_grad=True),),
            group=group))
    # scale_grads=False: PipelineStage divides every parameter of its module by M after the
    # last backward, and a rank's V stages share one model; the step divides each gradient
    # once instead (PipelineModel._scale_gradients)
    m = plan.pipeline_microbatches
    if plan.schedule == "interleaved":
        schedule = ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=identity_loss,
                                           scale_grads=False)
    else:
        schedule_class = ScheduleGPipe if plan.schedule == "gpipe" else Schedule1F1B
        schedule = schedule_class(stages[0], n_microbatches=m, loss_fn=identity_loss,
                                  scale_grads=False)
    return stages, schedule


def describe(model) -> str:
    """``model``: a PipelineModel."""
    def span(blocks: range) -> str:
        return f"{blocks.start}-{blocks.stop - 1}" if len(blocks) > 1 else f"{blocks.start}"
    how = f"{model.plan.schedule}, {model.plan.pipeline_microbatches} micro-batches"
    if len(model.chunks) == 1:
        owned = model.chunks[0]
        return (f"pipeline stage {model.stage_index} of {model.num_stages} "
                f"(blocks {owned.start}-{owned.stop - 1} of {len(model.block_paths)}, {how})")
    stages = ", ".join(f"{s} (blocks {span(c)})" for s, c in zip(model.stage_indices,
                                                                  model.chunks))
    return (f"pipeline rank {model.stage_index} of {model.plan.pp}: stages {stages} of "
            f"{model.num_stages} ({len(model.block_paths)} blocks, {how})")
