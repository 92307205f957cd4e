"""``pp=P`` x ``shard=zero2|zero3``: FSDP's gathered parameters and collective buffers per
pipeline stage, as ``apply`` realises it (``apply/pipeline_data_parallel.shard_blocks``).

apply runs ``fully_shard`` on each of a rank's blocks over its stage's data-parallel group,
then on the model as the root unit (the layers outside the stack).  So a stage gathers its
own blocks only, and every stage gathers the root (its forward runs the model's own
forward, embeddings included).  ``sharding.shard_additions`` places FSDP's rows for every
block of the model on the unmodified step; here they are dropped and made again per stage
from the same function, with the stage's blocks as the units and the layers outside the
stack as the root:

* zero2 (``reshard_after_forward=False``): the stage's blocks and the root gathered at
  their pre-forward and kept until their post-backward, which under the pipeline runs after
  every micro-batch's backward (torch's ``PipelineStage`` holds the model through a
  ``_Stage`` wrapper, not an ``FSDPModule``, so FSDP's hooks run per micro-batch: a later
  micro-batch gathers the block again in its backward);
* zero3 (``reshard_after_forward=True``): a block gathered in each micro-batch's forward,
  freed after it, gathered again for its backward with the next block prefetched.
* A stage before the last leaves the model's forward at its last block (the stage-stopping
  hook raises), so the root's post-forward never runs there: the root stays gathered and
  the all-gather buffer of the stage's last block, which that post-forward would free,
  stays alive until the next step's first gather (measured: gpt_lm 4 layers, rank 0).
  Under zero3 that buffer outlives the backward's re-gathers, so it is added for the
  backward (under zero2 the gather-free backward start already counts it).

Pure numpy (no torch).
"""
from __future__ import annotations

import numpy as np

from ..trace import schema
from .hardware import DEVICE_RULES
from .replay import CATEGORY_CODE, PHASE_CODE, Timeline
from .sharding import shard_additions

_PARAMETER = CATEGORY_CODE[schema.PARAMETER]
_GRADIENT = CATEGORY_CODE[schema.GRADIENT]
_OTHER = CATEGORY_CODE[schema.OTHER]
_FORWARD = PHASE_CODE[schema.FORWARD]
#: how long sharding.py's gloo copy of an all-gather buffer lives (key units)
_GATHER_COPY_SPAN = 0.01


def without_sharding_rows(timeline: Timeline) -> tuple[Timeline, dict]:
    """The timeline without the rows ``sharding.shard_additions`` appended (the run of rows
    at its end that no trace event refers to, of no op, module or shape: FSDP's gathered
    parameters and buffers), and the ``collective_copies`` rule they were made with (a
    backend copying its buffers, gloo: the CPU rule; none: NCCL's)."""
    referenced = np.zeros(len(timeline), bool)
    referenced[timeline.event_row[timeline.event_row >= 0]] = True
    added = (~referenced & (timeline.module == 0) & (timeline.op == 0)
             & (timeline.shape == "")
             & np.isin(timeline.category, [_PARAMETER, _OTHER]))
    start = len(timeline)
    while start > 0 and added[start - 1]:
        start -= 1
    tail = np.arange(start, len(timeline))
    copies = (DEVICE_RULES["cpu"] if np.any(np.isclose(
        timeline.free_key[tail] - timeline.alloc_key[tail], _GATHER_COPY_SPAN))
        else DEVICE_RULES["cuda"])["collective_copies"]
    sizes = timeline.size.copy()
    sizes[tail] = 0.0
    return timeline.resized(sizes), copies


def stage_rows(timeline: Timeline, shard: str, group: int, blocks: list[str],
               stage_blocks: list[int], block_parameter_fraction: dict[str, float],
               copies: dict, is_last: bool) -> dict:
    """FSDP's rows on one stage (unsharded bytes, ``shard_additions``' layout) with the
    stage's blocks as the units and the layers outside the stack as the root.
    ``timeline``: the per-rank one (model state already 1/``group``)."""
    mine = {blocks[i] for i in stage_blocks}
    others = [b for b in blocks if b not in mine]
    module_block = np.full(len(timeline.modules), "", dtype=object)
    for code, path in enumerate(timeline.modules):
        for block in others:
            if path == block or path.startswith(block + "."):
                module_block[code] = block
                break
    other_rows = module_block[timeline.module] != "" if len(timeline) else np.zeros(0, bool)
    state = (timeline.category == _PARAMETER) | (timeline.category == _GRADIENT)
    # the state rows back to whole tensors (shard_sizes took ceil(bytes / G)), other
    # stages' blocks out: shard_additions then sizes the root as the outside layers
    sizes = np.where(state, timeline.size * group, timeline.size)
    sizes = np.where(state & other_rows, 0.0, sizes)
    whole = float((timeline.size[timeline.category == _PARAMETER] * group).sum())
    local = float(sizes[timeline.category == _PARAMETER].sum())
    scale = whole / local if local > 0 else 0.0
    fractions = {blocks[i]: block_parameter_fraction.get(blocks[i], 0.0) * scale
                 for i in stage_blocks}
    rows, _ = shard_additions(timeline.resized(sizes), shard, [blocks[i] for i in stage_blocks],
                              fractions, copies)
    if not is_last:
        # the root's post-forward, which frees the last block's all-gather buffer, never
        # runs on this stage: the buffer lives on until the next forward gathers that
        # block again (accumulation releases a micro-step's outliving row when the next
        # one makes it again; FSDP frees it a little earlier, at the root's gather)
        buffers = np.flatnonzero((rows["category"] == _OTHER) & (rows["phase"] == _FORWARD))
        if len(buffers):
            last = buffers[np.argmax(rows["free_key"][buffers])]
            rows["free_key"] = rows["free_key"].copy()
            rows["free_key"][last] = float(timeline.n_events)
    return rows
