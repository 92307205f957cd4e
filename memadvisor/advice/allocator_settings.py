"""Caching-allocator settings: the reserved bytes ``expandable_segments`` and
``max_split_size_mb`` would give, found by replaying the step through the allocator model.

On a GPU target the unmodified script's allocation stream (the simulator's baseline plan:
the analysed step with the target's own additions, cuBLAS workspaces) is replayed through
``simulate.allocator`` with the default settings, with ``expandable_segments:True`` and
with up to four ``max_split_size_mb`` values (powers of two below the largest request).
Reserved minus the allocated peak is the fragmentation; a setting is advised only where it lowers the reserved peak, with the
``PYTORCH_CUDA_ALLOC_CONF`` text to set.

Settings the run already uses (``advise --expandable-segments``, or the
``PYTORCH_CUDA_ALLOC_CONF`` the profiled run recorded) are not advised again; with
expandable segments on, ``max_split_size_mb`` is not tried (it concerns split blocks of
fixed segments).

The allocator model never returns a segment (capacity unlimited here), so reserved only
grows and the two pools add up: ``max_split_size_mb`` touches only the large pool
(blocks over 1 MiB), which is replayed alone under it.  Its replay runs the Python loop
(the compiled one knows the default rules only, ~100x faster): it is skipped, and said,
above ``MAX_SPLIT_EVENTS`` large-pool events, so a long trace costs ``advise`` no more than
the vectorised passes.
"""
from __future__ import annotations

import numpy as np

from ..units import format_bytes
from . import MISSING, SUGGESTED, Advice

KIND = "allocator_settings"
#: below this much fragmentation (reserved over the allocated peak), nothing to win
MIN_FRAGMENTATION_BYTES = 20 << 20
#: a setting must save at least this much reserved memory to be advised
MIN_SAVING_BYTES = 2 << 20
#: the Python replay's cost bound (~1.5 us per event: ~0.08 s per value tried)
MAX_SPLIT_EVENTS = 50_000
#: how many max_split_size_mb values are replayed at most
MAX_SPLIT_CANDIDATES = 4


def allocator_settings_advice(context) -> list[Advice]:
    hw = context.hardware
    if hw is None or hw.device_type != "cuda":
        return []
    from ..simulate.allocator import SMALL_SIZE, replay
    from ..simulate.allocator_config import AllocatorConfig
    sizes, rows = _baseline_stream(context)
    if not len(sizes):
        return []
    already = _settings_in_use(context)
    default = replay(sizes, rows)
    fragmentation = default.peak_reserved_bytes - default.peak_allocated_bytes
    if fragmentation < MIN_FRAGMENTATION_BYTES:
        return []
    found = []
    base = {"reserved_bytes_default": int(default.peak_reserved_bytes),
            "allocated_peak_bytes": int(default.peak_allocated_bytes),
            "fragmentation_bytes": int(fragmentation)}
    expandable = replay(sizes, rows, expandable_segments=True)
    saved = default.peak_reserved_bytes - expandable.peak_reserved_bytes
    if saved >= MIN_SAVING_BYTES and not already.expandable_segments:
        found.append(_advice("expandable_segments:True", saved,
                             expandable.peak_reserved_bytes, base,
                             "one growing segment per pool, mapped in pages: no block is "
                             "stranded in a segment too small for the next request"))
    rounded = np.maximum((np.abs(sizes).round().astype(np.int64) + 511) & -512, 512)
    large = rounded > SMALL_SIZE
    candidates = [] if already.max_split_size_bytes or already.expandable_segments else \
        _split_candidates(rounded[large & (sizes > 0)])
    if candidates and int(large.sum()) > MAX_SPLIT_EVENTS:
        found.append(Advice(
            kind=KIND, status=MISSING, title="max_split_size_mb not tried",
            location="PYTORCH_CUDA_ALLOC_CONF",
            reason=f"the step has {int(large.sum()):,} large-pool events, over the "
                   f"{MAX_SPLIT_EVENTS:,} the allocator model's Python replay (the only one "
                   "that honours max_split_size_mb) is run on here",
            details=base))
        return found
    if candidates:
        large_default = replay(sizes[large], rows[large]).peak_reserved_bytes
        best = None
        for megabytes in candidates:
            config = AllocatorConfig(max_split_size_bytes=megabytes << 20)
            reserved = replay(sizes[large], rows[large], config=config).peak_reserved_bytes
            if best is None or reserved < best[1]:
                best = (megabytes, reserved)
        saved = large_default - best[1]
        if saved >= MIN_SAVING_BYTES:
            found.append(_advice(f"max_split_size_mb:{best[0]}", saved,
                                 default.peak_reserved_bytes - saved, base,
                                 f"blocks of {best[0]} MiB or more are never split, so the "
                                 "large requests stop carving up each other's segments "
                                 f"(tried {', '.join(map(str, candidates))} MiB)"))
    return found


def _settings_in_use(context):
    """The allocator settings the run already has (``advise --expandable-segments``, or
    the ``PYTORCH_CUDA_ALLOC_CONF`` the profiled run recorded): not advised again.  Text
    the model cannot read counts as none."""
    from ..errors import UserError
    from ..simulate.allocator_config import (AllocatorConfig, config_from_snapshot,
                                             parse_alloc_conf)
    text = context.alloc_conf
    recorded = (context.trace.meta.allocator or {}).get("settings")
    try:
        if text is not None:
            return parse_alloc_conf(text)
        if isinstance(recorded, dict):
            return config_from_snapshot(recorded, strict=False)
        return parse_alloc_conf(recorded if isinstance(recorded, str) else "")
    except UserError:
        return AllocatorConfig()


def _baseline_stream(context) -> tuple[np.ndarray, np.ndarray]:
    """The unmodified script's allocation stream on the target, as ``simulate`` replays
    it (signed sizes, row of each event)."""
    from ..plan import Plan
    from ..simulate import simulate
    from ..simulate.replay import replay_events
    prediction = simulate(context.base, Plan(), context.hardware, run_allocator=False,
                          categories=False)
    return replay_events(prediction.timeline)


def _split_candidates(large_requests: np.ndarray) -> list[int]:
    """max_split_size_mb values worth a replay: powers of two from 32 MiB (c10 requires
    over 20) below the largest request (a limit above every request changes nothing),
    at most ``MAX_SPLIT_CANDIDATES`` of them spread evenly between the two."""
    if not len(large_requests):
        return []
    largest_mb = float(large_requests.max()) / 2**20
    values = []
    megabytes = 32
    while megabytes < largest_mb:
        values.append(megabytes)
        megabytes *= 2
    if len(values) > MAX_SPLIT_CANDIDATES:
        picks = np.linspace(0, len(values) - 1, MAX_SPLIT_CANDIDATES).round().astype(int)
        values = [values[i] for i in sorted(set(picks.tolist()))]
    return values


def _advice(setting: str, saved: int, reserved: int, base: dict, why: str) -> Advice:
    return Advice(
        kind=KIND, status=SUGGESTED, bytes_saved=int(saved),
        title=f"PYTORCH_CUDA_ALLOC_CONF={setting}",
        location="PYTORCH_CUDA_ALLOC_CONF",
        reason=(f"the allocator model reserves {format_bytes(base['reserved_bytes_default'])} "
                f"for a {format_bytes(base['allocated_peak_bytes'])} allocated peak "
                f"({format_bytes(base['fragmentation_bytes'])} fragmentation); with "
                f"{setting}, {format_bytes(reserved)}: {why}.  Saves reserved memory, "
                "not the allocated peak"),
        details={**base, "setting": setting, "reserved_bytes": int(reserved),
                 "alloc_conf": f"PYTORCH_CUDA_ALLOC_CONF={setting}"})
