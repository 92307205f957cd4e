"""Replaying a snapshot's recorded addresses: every block's size, reserved memory over time.

A snapshot's ``alloc`` events carry the *requested* size and the address the allocator
chose; ``max_memory_allocated`` counts *block* sizes, which differ where a request was
rounded or took a whole free block that was not worth splitting.  Replaying the recorded
addresses through the allocator's own split and merge rules (c10/cuda/
CUDACachingAllocator.cpp; constants shared with ``simulate.allocator``) recovers each
block exactly, and the ``segments`` of the dump check the result block by block.

Blocks alive before recording began have no ``alloc`` event: they are the addresses whose
first event is a free, and the live blocks of the dump never allocated in the trace.  Their
size is the recorded block size when the dump still holds them, else the request rounded,
plus any gap to the next block smaller than the smallest block the pool can hold (large
pool: every block is over 1 MiB; small pool: at least 512 B), which can only be theirs.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from ..simulate.allocator import MIN_BLOCK, SMALL_BUFFER, SMALL_SIZE, CachingAllocator
from ..simulate.allocator_config import config_from_snapshot

ALLOC, FREE_REQUESTED, FREE_COMPLETED = "alloc", "free_requested", "free_completed"
SEGMENT_ALLOC, SEGMENT_FREE = "segment_alloc", "segment_free"
SEGMENT_MAP, SEGMENT_UNMAP = "segment_map", "segment_unmap"


@dataclass
class Lifetime:
    """One block from its allocation (or the start of recording) to its free (or the dump)."""

    address: int
    requested_bytes: int
    block_bytes: int
    stream: int
    alloc_event: int  #: index into the device trace; -1: alive when recording began
    free_event: int = -1  #: index of its free_requested; -1: alive at the dump
    frames: list = field(default_factory=list)  #: the alloc event's (or the dump block's)


@dataclass
class Layout:
    lifetimes: list[Lifetime]
    initial_segments: list[dict]  #: {address, total_size, stream, small} when recording began
    #: each segment event: (event index, action, address, bytes, stream, reserved bytes
    #: after it, segments after it)
    segment_events: list[tuple[int, str, int, int, int, int, int]]
    initial_reserved_bytes: int
    peak_reserved_bytes: int
    peak_allocated_bytes: int  #: block sizes, from recording's start (max_memory_allocated)
    segments_at_end: int
    #: blocks of the dump whose recorded size differs from the replay's (0: exact)
    block_mismatches: int
    blocks_checked: int
    #: events the replay could not place (an alloc into no free block, a free of nothing)
    unplaced_events: int
    #: the allocator's own ``oom`` events: (event index, requested bytes, device free bytes)
    oom_events: list[tuple[int, int, int]] = field(default_factory=list)


class _Segment:
    __slots__ = ("address", "size", "stream", "small", "starts", "blocks")

    def __init__(self, address, size, stream, small):
        self.address, self.size, self.stream, self.small = address, size, stream, small
        self.starts = [address]  # sorted block start addresses
        self.blocks = {address: [size, True]}  # start -> [size, free]

    def block_at(self, address):
        index = bisect.bisect_right(self.starts, address) - 1
        start = self.starts[index]
        return start, self.blocks[start]

    def split(self, start, at):
        """Cut the block at ``start`` in two at address ``at`` (same state both sides)."""
        size, free = self.blocks[start]
        self.blocks[start] = [at - start, free]
        self.blocks[at] = [start + size - at, free]
        bisect.insort(self.starts, at)

    def merge_free(self, start):
        index = self.starts.index(start)
        if index + 1 < len(self.starts):
            after = self.starts[index + 1]
            if self.blocks[after][1]:
                self.blocks[start][0] += self.blocks.pop(after)[0]
                del self.starts[index + 1]
        if index > 0:
            before = self.starts[index - 1]
            if self.blocks[before][1]:
                self.blocks[before][0] += self.blocks.pop(start)[0]
                del self.starts[index]


def replay_layout(snapshot: dict, device: int = 0) -> Layout:
    config = config_from_snapshot(snapshot.get("allocator_settings"), strict=False)
    rules = CachingAllocator(config=config)  # its rounding and split rules, nothing else
    traces = snapshot.get("device_traces") or []
    events = traces[device] if device < len(traces) else []
    dump_segments = [s for s in snapshot["segments"] if s.get("device", device) == device]

    made_in_trace = {e["addr"] for e in events if e["action"] == SEGMENT_ALLOC}
    segments: dict[int, _Segment] = {}
    for s in dump_segments:
        if s["address"] not in made_in_trace:
            segments[s["address"]] = _Segment(s["address"], s["total_size"], s.get("stream", 0),
                                              _is_small(s))
    for e in events:  # freed during the recording, made before it
        if e["action"] == SEGMENT_FREE and e["addr"] not in made_in_trace \
                and e["addr"] not in segments:
            segments[e["addr"]] = _Segment(e["addr"], e["size"], e.get("stream", 0),
                                           e["size"] == SMALL_BUFFER)
    initial_segments = [{"address": s.address, "total_size": s.size, "stream": s.stream,
                         "small": s.small} for s in sorted(segments.values(),
                                                           key=lambda s: s.address)]
    bases = sorted(segments)
    lifetimes: list[Lifetime] = []
    live: dict[int, Lifetime] = {}
    initial = _initial_blocks(events, dump_segments)
    for address, (requested, block, stream, frames) in sorted(initial.items()):
        segment = _segment_of(segments, bases, address)
        if segment is None:
            continue
        life = Lifetime(address, requested, block, stream, -1, frames=frames)
        lifetimes.append(life)
        live[address] = life
    for segment in segments.values():
        _place_initial(segment, config, [life for a, life in live.items()
                                 if segment.address <= a < segment.address + segment.size])

    reserved = sum(s.size for s in segments.values())
    initial_reserved = peak_reserved = reserved
    allocated = peak_allocated = sum(life.block_bytes for life in live.values())
    timeline, unplaced, ooms = [], 0, []
    pending_free: dict[int, Lifetime] = {}
    for index, e in enumerate(events):
        action, address = e["action"], e["addr"]
        if action == ALLOC:
            segment = _segment_of(segments, bases, address)
            rounded = config.round_size(e["size"])
            block = _take(segment, address, rounded, rules) if segment is not None else None
            if block is None:
                unplaced += 1
                block = rounded
            life = Lifetime(address, e["size"], block, e.get("stream", 0), index,
                            frames=e.get("frames") or [])
            lifetimes.append(life)
            live[address] = life
            allocated += block
            peak_allocated = max(peak_allocated, allocated)
        elif action == FREE_REQUESTED:
            life = live.pop(address, None)
            if life is None:
                unplaced += 1
                continue
            life.free_event = index
            allocated -= life.block_bytes  # the allocator's stats drop at free()
            pending_free[address] = life
        elif action == FREE_COMPLETED:
            life = pending_free.pop(address, None)
            segment = _segment_of(segments, bases, address)
            if life is None or segment is None or address not in segment.blocks:
                unplaced += life is None
                continue
            segment.blocks[address][1] = True
            segment.merge_free(address)
        elif action in (SEGMENT_ALLOC, SEGMENT_MAP):
            segments[address] = _Segment(address, e["size"], e.get("stream", 0),
                                         e["size"] == SMALL_BUFFER)
            bisect.insort(bases, address)
            reserved += e["size"]
            peak_reserved = max(peak_reserved, reserved)
            timeline.append((index, action, address, e["size"], e.get("stream", 0), reserved,
                             len(segments)))
        elif action == "oom":
            ooms.append((index, int(e.get("size", 0)), int(e.get("device_free", 0) or 0)))
        elif action in (SEGMENT_FREE, SEGMENT_UNMAP):
            if segments.pop(address, None) is not None:
                bases.remove(address)
            reserved -= e["size"]
            timeline.append((index, action, address, e["size"], e.get("stream", 0), reserved,
                             len(segments)))
    mismatches, checked = _check_against_dump(segments, dump_segments)
    return Layout(lifetimes, initial_segments, timeline, initial_reserved, peak_reserved,
                  peak_allocated, len(segments), mismatches, checked, unplaced, ooms)


def _is_small(segment: dict) -> bool:
    kind = segment.get("segment_type")
    return kind == "small" if kind in ("small", "large") else segment["total_size"] == SMALL_BUFFER


def _segment_of(segments, bases, address):
    index = bisect.bisect_right(bases, address) - 1
    if index < 0:
        return None
    segment = segments[bases[index]]
    return segment if address < segment.address + segment.size else None


def _initial_blocks(events, dump_segments) -> dict[int, tuple]:
    """Blocks alive when recording began: address -> (requested, block bytes, stream,
    frames); block bytes 0 where only the request is known (fixed by ``_place_initial``)."""
    seen, initial = set(), {}
    for e in events:
        if e["action"] == ALLOC:
            seen.add(e["addr"])
        elif e["action"] == FREE_REQUESTED and e["addr"] not in seen:
            seen.add(e["addr"])
            # its free's frames say where it died, not where it was made: none kept
            initial[e["addr"]] = (e["size"], 0, e.get("stream", 0), [])
    for s in dump_segments:
        for b in s["blocks"]:
            if b.get("state", "").startswith("active") and b["address"] not in seen:
                initial[b["address"]] = (b.get("requested_size", b["size"]), b["size"],
                                         s.get("stream", 0), b.get("frames") or [])
    return initial


def _place_initial(segment: _Segment, config, lives: list[Lifetime]) -> None:
    lives = sorted(lives, key=lambda life: life.address)
    ends = [life.address for life in lives[1:]] + [segment.address + segment.size]
    smallest_block = MIN_BLOCK if segment.small else SMALL_SIZE + 1
    for life, next_start in zip(lives, ends):
        if not life.block_bytes:
            size = config.round_size(life.requested_bytes)
            gap = next_start - (life.address + size)
            life.block_bytes = size + gap if 0 < gap < smallest_block else size
        start, (size, _) = segment.block_at(life.address)
        if start < life.address:
            segment.split(start, life.address)
        end = life.address + life.block_bytes
        if end < life.address + segment.blocks[life.address][0]:
            segment.split(life.address, end)
        segment.blocks[life.address][1] = False


def _take(segment: _Segment, address: int, rounded: int, rules) -> int | None:
    start, (size, free) = segment.block_at(address)
    if not free or start + size < address + rounded:
        return None
    if start < address:  # the replay's free block began earlier than the real one
        segment.split(start, address)
        size = segment.blocks[address][0]
    if rules.splits(rounded, size - rounded, segment.small):
        segment.split(address, address + rounded)
    segment.blocks[address][1] = False
    return segment.blocks[address][0]


def _check_against_dump(segments, dump_segments) -> tuple[int, int]:
    mismatches = checked = 0
    for s in dump_segments:
        mine = segments.get(s["address"])
        for b in s["blocks"]:
            if not b.get("state", "").startswith("active"):
                continue
            checked += 1
            if mine is None or mine.blocks.get(b["address"], [0, True]) != [b["size"], False]:
                mismatches += 1
    return mismatches, checked
