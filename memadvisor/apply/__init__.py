"""Realise a memory plan in a training script.

A rewritten script calls this package at a few points, in the style of accelerate::

    import memadvisor.apply as mem
    model, optimizer = mem.prepare(model, optimizer, plan="precision=amp-bf16,accum=2")
    for x, y in mem.micro_batches(x, y):   # this rank's micro-batches of the batch
        loss = criterion(model(x), y)
        mem.backward(loss)                  # scaled by 1/accum (and the fp16 loss scale)
    mem.step(optimizer)

``memadvisor.apply.rewrite`` makes those edits, ``memadvisor.apply.launch`` runs the result
in one process or under torchrun.  See docs/APPLY.md.
"""
import os as _os

#: what a rewritten script calls (``runtime``, which imports torch), loaded on first use:
#: ``advise`` and ``simulate`` import this package to rewrite scripts, not to run them
_RUN_TIME = frozenset({
    "backward", "clip_grad_norm_", "clip_grad_value_", "current_session", "finish",
    "micro_batches", "prepare", "step", "unscale_", "unwrap"})

if "LOCAL_RANK" in _os.environ:
    # under torchrun "cuda" must mean this rank's GPU before the script moves its model
    # there, i.e. as the rewritten script imports this package
    from .sharding import select_local_device as _select_local_device
    _select_local_device()


def __getattr__(name: str):
    if name in _RUN_TIME:
        from . import runtime
        return getattr(runtime, name)
    if name == "with_loss":  # pp's rewrite of a loss the script computes (loss_expression.py)
        from .pipeline_loss import with_loss
        return with_loss
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
