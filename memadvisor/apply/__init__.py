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
from .runtime import (  # noqa: F401
    backward, clip_grad_norm_, clip_grad_value_, current_session, finish, micro_batches,
    prepare, step, unscale_, unwrap,
)
from .sharding import select_local_device as _select_local_device

# "cuda" must mean this rank's GPU before the script moves its model there
_select_local_device()
