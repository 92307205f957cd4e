"""Activation checkpointing (non-reentrant ``torch.utils.checkpoint``) as a stream transform.

For each checkpointed region (a module path and its submodules; '' is the whole model):

* forward: activations the region saves for its own backward (allocated in the region's
  forward, still alive when the region's backward starts) are freed when the region's
  forward ends instead;  the region's output, saved downstream, keeps its lifetime.  A
  step with several backward passes calls the region once per pass (a GAN's
  discriminator): each call, with the backward that follows it, is transformed alone;
* backward: just before the region's first backward allocation its forward is replayed
  (activations and temporaries, in their order) up to the last saved tensor (non-reentrant
  checkpoint stops recomputing early there); recomputed activations then die at their
  original backward frees, recomputed temporaries as they did in forward;
* on a CPU model, ``preserve_rng_state`` keeps a copy of the CPU generator state
  (``CPU_RNG_STATE_BYTES``) from the region's forward until its backward is done, and the
  recompute (under ``fork_rng``) holds one more while it runs.

Regions are located from alloc events only: a free row carries its storage's allocation
module, not the module running when it is freed.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..trace import schema
from .replay import CATEGORY_CODE, PHASE_CODE, Timeline

CPU_RNG_STATE_BYTES = 5056  #: torch.get_rng_state() of the default CPU generator (mt19937)

_FORWARD = PHASE_CODE[schema.FORWARD]
_BACKWARD = PHASE_CODE[schema.BACKWARD]


@dataclass(frozen=True)
class RegionEffect:
    path: str
    freed_bytes: int  #: activations no longer kept between forward and backward
    recompute_positions: tuple[int, int]  #: forward event span replayed in backward


def _in_region(modules: list[str], region: str) -> np.ndarray:
    if region == "":
        return np.ones(len(modules), bool)
    return np.array([m == region or m.startswith(region + ".") for m in modules])


def apply_checkpoint(timeline: Timeline, regions: list[str], device_type: str = "cpu"
                     ) -> tuple[Timeline, list[RegionEffect]]:
    effects = []
    for region in regions:
        timeline, effect = _checkpoint_region(timeline, region, device_type)
        if effect is not None:
            effects.append(effect)
    return timeline, effects


def _checkpoint_region(timeline: Timeline, region: str, device_type: str):
    member = _in_region(timeline.modules, region)
    allocs = timeline.event_is_alloc & member[timeline.event_module]
    forward_allocs = np.flatnonzero(allocs & (timeline.event_phase == _FORWARD))
    backward_allocs = np.flatnonzero(allocs & (timeline.event_phase == _BACKWARD))
    if not len(forward_allocs) or not len(backward_allocs):
        return timeline, None
    freed, spans = 0, []
    for calls in _calls(timeline, forward_allocs):
        start, end = int(calls[0]), int(calls[-1])
        after = backward_allocs[backward_allocs > end]
        if not len(after):
            continue
        timeline, saved_bytes, last_saved = _checkpoint_call(
            timeline, member, start, end, after, device_type)
        if saved_bytes:
            freed += saved_bytes
            spans.append((start, last_saved))
    if not spans:
        return timeline, None
    return timeline, RegionEffect(region, freed, (spans[0][0], spans[-1][1]))


def _calls(timeline: Timeline, forward_allocs: np.ndarray) -> list[np.ndarray]:
    """The region's forward allocations split where a backward pass runs between them: a
    step with several backward passes (a GAN's discriminator on real, then on generated
    data, then for the generator's loss) calls the region once per pass, and each call's
    recompute runs in the backward that uses its saved tensors, not in the step's first."""
    backward_so_far = np.cumsum(timeline.event_phase == _BACKWARD)
    passes = backward_so_far[forward_allocs]
    return np.split(forward_allocs, np.flatnonzero(np.diff(passes)) + 1)


def _checkpoint_call(timeline: Timeline, member: np.ndarray, start: int, end: int,
                     backward_after: np.ndarray, device_type: str):
    """One call of the region (forward allocations ``start``..``end``); its backward is the
    region's next backward allocations (``backward_after``, up to the end of that pass).
    Returns the timeline, the bytes no longer kept and the last saved row's key."""
    backward_start = int(backward_after[0])
    # the pass that backward runs in: it ends at the next event outside backward
    outside = np.flatnonzero(timeline.event_phase[backward_start:] != _BACKWARD)
    pass_end = backward_start + int(outside[0]) if len(outside) else timeline.n_events
    backward_last = int(backward_after[backward_after < pass_end][-1])

    in_span = (timeline.alloc_key >= start) & (timeline.alloc_key <= end)
    row_member = member[timeline.module] & in_span
    activation = timeline.category == CATEGORY_CODE[schema.ACTIVATION]
    saved = row_member & activation & (timeline.free_key >= backward_start)
    if not saved.any():
        return timeline, 0, start
    last_saved = float(timeline.alloc_key[saved].max())

    # recompute: rows of the region made up to the last saved one, replayed before backward
    replay = row_member & (timeline.alloc_key <= last_saved) & (timeline.size > 0)
    span = last_saved - start + 2.0

    def squeeze(key):
        return backward_start - 1.0 + (key - start + 1.0) / (span + 1.0)

    recompute_end = squeeze(last_saved + 0.5)
    new_alloc = squeeze(timeline.alloc_key[replay])
    freed_in_span = timeline.free_key[replay] <= last_saved
    new_free = np.where(saved[replay], timeline.free_key[replay],
                        np.where(freed_in_span, squeeze(timeline.free_key[replay]),
                                 recompute_end))
    free_key = timeline.free_key.copy()
    # freed when the region's forward ends, and in any case before its recompute begins
    # (a region whose forward ends right before backward, e.g. the whole model: its
    # originals and their recomputed copies never coexist)
    free_key[saved] = min(end + 0.5, squeeze(start - 0.75))
    out = timeline.retimed(timeline.alloc_key, free_key)
    rows = {name: getattr(timeline, name)[replay] for name in (
        "size", "category", "dtype", "module", "phase", "op", "scales_with_batch", "shape")}
    rows["alloc_key"], rows["free_key"] = new_alloc, new_free
    # recomputed tensors are made in backward; temporaries stay temporaries
    rows["phase"] = np.full(int(replay.sum()), _BACKWARD, np.int8)
    out = out.appended(rows)
    if device_type == "cpu":
        # the generator state saved in forward lives until the region's backward is done
        # (checkpoint's frame lets go of it then); the recompute runs under fork_rng, which
        # holds the current state meanwhile
        out = out.appended({
            "size": np.full(2, CPU_RNG_STATE_BYTES, float),
            "alloc_key": np.array([start - 0.5, squeeze(start - 0.5)]),
            "free_key": np.array([float(backward_last) + 0.5, recompute_end]),
            "category": np.full(2, CATEGORY_CODE[schema.OTHER], np.int8),
            "phase": np.array([_FORWARD, _BACKWARD], np.int8)})
    return out, int(timeline.size[saved].sum()), int(last_saved)
