"""``pp=P`` with the script's loss: ``with_loss``, what the rewrite of a loss the script
computes calls (loss_expression.py), and the checks the pipeline makes of that loss.

The loss function runs inside the last stage's forward rather than as torch's
``loss_fn(output, target)`` on the stage's output because: the output may be any structure
(a tuple, a dict) where a stage sends and validates tensors; the stage would keep each
micro-batch's output (the logits) for its backward besides what autograd saves; and
``target`` is one tensor where a loss may read several."""
from __future__ import annotations

import contextlib

import torch

from ..plan import PlanError


def loss_position(output):
    """Where the model's output holds its loss (a 0-dim floating tensor), or None."""
    def is_loss(value):
        return (isinstance(value, torch.Tensor) and value.dim() == 0
                and value.is_floating_point())
    if is_loss(output):
        return ("tensor", None)
    if isinstance(output, (tuple, list)):
        hits = [i for i, v in enumerate(output) if is_loss(v)]
        if len(hits) == 1:
            return (type(output).__name__, (len(output), hits[0]))
    if isinstance(output, dict):
        hits = [k for k, v in output.items() if is_loss(v)]
        if len(hits) == 1:
            return ("dict", (tuple(output), hits[0]))
    return None


def check_loss(loss, loss_fn, num_stages: int) -> None:
    """PlanError unless the script's loss function gave one floating number (the schedule
    averages the micro-batches' losses and backpropagates each)."""
    if (isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point()):
        return
    code = loss_fn.__code__
    what = (f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor)
            else type(loss).__name__)
    raise PlanError(f"pp={num_stages}: the script's loss ({code.co_filename}, line "
                    f"{code.co_firstlineno}: `{loss_fn.__name__}`) gives {what}, not one "
                    "number: the pipeline averages one loss per micro-batch")


def parameter_name(loss_fn, index: int) -> str:
    """The name the loss function gives its argument ``index`` (the rewrite names the
    batch tensors as the script does): for messages."""
    names = loss_fn.__code__.co_varnames if loss_fn is not None else ()
    return names[index] if index < len(names) else f"argument {index}"


def entered(context):
    """The script's ``with`` context made anew (``context()``), or nothing."""
    return context() if context is not None else contextlib.nullcontext()


def with_loss(model, loss_fn, *targets, context=None):
    """``model`` to call with ``loss_fn(output, *targets)`` as its loss: what the pp
    rewrite of a script-side loss calls (loss_expression.py).  Under a pipeline the schedule
    computes it on the last stage per micro-batch and the call returns the step's mean
    loss; otherwise it is computed here, so the rewritten script runs under any plan.
    ``context``: makes the ``with`` context the script ran its forward in (autocast),
    entered around the forward only -- the backward, which the pipeline runs inside the
    call, ran outside it in the script."""
    from .pipeline_parallel import PipelineModel  # which imports this module

    pipeline = model if isinstance(model, PipelineModel) else getattr(model, "__self__", None)
    if isinstance(pipeline, PipelineModel):
        def run_pipeline(*args, **kwargs):
            return pipeline.forward_with_loss(loss_fn, targets, context, *args, **kwargs)
        return run_pipeline

    def run(*args, **kwargs):
        with entered(context):
            output = model(*args, **kwargs)
        return loss_fn(output, *targets)
    return run
