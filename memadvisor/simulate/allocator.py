"""A model of the CUDA caching allocator, replayed over a plan's allocation stream.

Constants and rules are c10/cuda/CUDACachingAllocator.cpp's (see shared FACTS.md):
requests round up to 512 B; <= 1 MiB goes to the small pool, the rest to the large pool;
a new segment is 2 MiB (small), 20 MiB (large requests < 10 MiB) or the request rounded
up to 2 MiB; a request takes the best-fitting free block of its pool (smallest, then
lowest address); a block is split when the remainder is >= 512 B (small pool) or
> 1 MiB (large pool); freed blocks merge with free neighbours; segments are never
returned unless a new segment would exceed the device (then every fully free segment is
released and the request retried, as on a failed cudaMalloc).

``expandable_segments``: one growing segment per pool mapped in 2 MiB (small) / 20 MiB
(large) pages; modelled as the pool's live block bytes rounded up to whole pages, at the
worst moment (fragmentation inside the mapped range is ignored).

``max_split_size_mb`` and ``roundup_power2_divisions`` are honoured (``allocator_config``;
the Python loop runs then).  Not modelled: warm-up history before the analysed step (the
stream starts with the storages alive across the step, allocated in order; a recorded
state can be given instead, ``add_segment``/``place``), several streams, record_stream.
"""
from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from . import native_allocator
from .allocator_config import AllocatorConfig

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20


def round_size(size: int) -> int:
    if size < MIN_BLOCK:
        return MIN_BLOCK
    return -(-size // MIN_BLOCK) * MIN_BLOCK


def segment_size(rounded: int) -> int:
    if rounded <= SMALL_SIZE:
        return SMALL_BUFFER
    if rounded < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-rounded // ROUND_LARGE) * ROUND_LARGE


@dataclass
class AllocatorResult:
    peak_allocated_bytes: int  #: max of live block bytes (torch.cuda.max_memory_allocated)
    peak_reserved_bytes: int  #: max of segment bytes (torch.cuda.max_memory_reserved)
    segments: int
    out_of_memory: bool = False
    complete: bool = True  #: False: stopped early once reserved passed ``stop_above_bytes``


class _Block:
    __slots__ = ("segment", "offset", "size", "free", "prev", "next")

    def __init__(self, segment, offset, size, free, prev=None, next=None):
        self.segment, self.offset, self.size, self.free = segment, offset, size, free
        self.prev, self.next = prev, next


class CachingAllocator:
    def __init__(self, capacity_bytes: int = 0, config: AllocatorConfig | None = None):
        self.capacity = capacity_bytes or (1 << 62)
        self.config = config or AllocatorConfig()
        #: blocks at or over it are never split (0: no limit), PYTORCH_CUDA_ALLOC_CONF
        self.max_split = self.config.max_split_size_bytes or (1 << 62)
        # pool -> sorted [(size, segment, offset)]; a pool is ``small`` (bool) on the default
        # stream and (stream, small) on another: each stream caches its own blocks
        self.free_lists = defaultdict(list, {True: [], False: []})
        self.blocks: dict[tuple[int, int], _Block] = {}
        self.segment_sizes: dict[int, tuple[int, bool]] = {}
        self.next_segment = 0
        self.allocated = 0
        self.reserved = 0
        self.peak_allocated = 0
        self.peak_reserved = 0
        self.out_of_memory = False

    def _key(self, block: _Block):
        return (block.size, block.segment, block.offset)

    def _insert_free(self, block: _Block, small: bool):
        block.free = True
        bisect.insort(self.free_lists[small], self._key(block))

    def _remove_free(self, block: _Block, small: bool):
        items = self.free_lists[small]
        index = bisect.bisect_left(items, self._key(block))
        del items[index]

    def malloc(self, size: int, stream: int = 0) -> _Block:
        rounded = self.config.round_size(size)
        small = rounded <= SMALL_SIZE
        return self.malloc_rounded(rounded, small if not stream else (stream, small))

    def splits(self, rounded: int, remaining: int, small: bool) -> bool:
        """``should_split``: small pool at >= 512 B left; large pool at > 1 MiB left, for
        requests under max_split_size."""
        if small:
            return remaining >= MIN_BLOCK
        return rounded < self.max_split and remaining > SMALL_SIZE

    def _usable(self, items, index: int, rounded: int) -> bool:
        """``get_free_block``'s max_split_size rules for the best-fitting block: requests
        under the limit never take an oversize block, requests over it only one within
        20 MiB of their size (larger blocks come later in the list, so the first decides)."""
        if index == len(items):
            return False
        size = items[index][0]
        if rounded < self.max_split:
            return size < self.max_split
        return size < rounded + LARGE_BUFFER

    def fits_cached(self, rounded: int, small: bool) -> bool:
        """Whether a request of ``rounded`` bytes would reuse a cached block (no new segment)."""
        items = self.free_lists[small]
        return bool(items) and items[-1][0] >= rounded

    def malloc_rounded(self, rounded: int, pool) -> _Block:
        """``pool``: ``small`` (bool) on the default stream, (stream, small) on another."""
        small = pool if isinstance(pool, bool) else pool[1]
        items = self.free_lists[pool]
        index = bisect.bisect_left(items, (rounded, -1, -1))
        if not self._usable(items, index, rounded):
            self._new_segment(segment_size(rounded), pool)
            # the new segment is the only block of its size and id: find it exactly
            key = (segment_size(rounded), self.next_segment - 1, 0)
            index = bisect.bisect_left(items, key)
        _, segment, offset = items[index]
        block = self.blocks[(segment, offset)]
        del items[index]
        block.free = False
        remaining = block.size - rounded
        if self.splits(rounded, remaining, small):
            rest = self._cut(block, rounded, True)
            bisect.insort(items, (remaining, segment, rest.offset))
        self.allocated += block.size
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        return block

    def _cut(self, block: _Block, size: int, rest_free: bool) -> _Block:
        """Split ``block`` after ``size`` bytes; returns the second part (not in a free list)."""
        rest = _Block(block.segment, block.offset + size, block.size - size, rest_free, block,
                      block.next)
        if block.next is not None:
            block.next.prev = rest
        block.next, block.size = rest, size
        self.blocks[(block.segment, rest.offset)] = rest
        return rest

    def add_segment(self, nbytes: int, small, stream: int = 0) -> int:
        """A segment that already exists (a recorded starting state): all free, no OOM
        check.  Returns its id; ids grow, and ties in best fit go to the lower id.
        ``small`` may be a pool key already (``malloc_rounded``'s)."""
        if stream and isinstance(small, bool):
            small = (stream, small)
        segment = self.next_segment
        self.next_segment += 1
        self.segment_sizes[segment] = (nbytes, small)
        block = _Block(segment, 0, nbytes, True)
        self.blocks[(segment, 0)] = block
        self._insert_free(block, small)
        self.reserved += nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return segment

    def place(self, segment: int, offset: int, size: int) -> _Block:
        """Mark ``size`` bytes at ``offset`` of ``segment`` allocated (a block alive when the
        recorded state begins), carving it out of the free block that covers it."""
        small = self.segment_sizes[segment][1]
        start = max(o for (s, o), b in self.blocks.items()
                    if s == segment and o <= offset and b.free and o + b.size >= offset + size)
        block = self.blocks[(segment, start)]
        self._remove_free(block, small)
        if start < offset:  # the free part before it stays free
            tail = self._cut(block, offset - start, False)
            self._insert_free(block, small)
            block = tail
        if block.size > size:
            self._insert_free(self._cut(block, size, True), small)
        block.free = False
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block

    def _new_segment(self, nbytes: int, small: bool):
        if self.reserved + nbytes > self.capacity:
            self._release_free_segments()
            if self.reserved + nbytes > self.capacity:
                self.out_of_memory = True
        self.add_segment(nbytes, small)

    def _release_free_segments(self):
        for segment, (nbytes, small) in list(self.segment_sizes.items()):
            block = self.blocks.get((segment, 0))
            if block is not None and block.free and block.size == nbytes:
                self._remove_free(block, small)
                del self.blocks[(segment, 0)]
                del self.segment_sizes[segment]
                self.reserved -= nbytes

    def free(self, block: _Block):
        small = self.segment_sizes[block.segment][1]
        self.allocated -= block.size
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                self._remove_free(neighbour, small)
                del self.blocks[(neighbour.segment, neighbour.offset)]
                if neighbour is block.prev:
                    del self.blocks[(block.segment, block.offset)]
                    neighbour.size += block.size
                    neighbour.next = block.next
                    if block.next is not None:
                        block.next.prev = neighbour
                    self.blocks[(neighbour.segment, neighbour.offset)] = neighbour
                    block = neighbour
                else:
                    block.size += neighbour.size
                    block.next = neighbour.next
                    if neighbour.next is not None:
                        neighbour.next.prev = block
        self._insert_free(block, small)


def replay(signed_sizes: np.ndarray, rows: np.ndarray, capacity_bytes: int = 0,
           expandable_segments: bool = False, stop_above_bytes: int = 0,
           native: bool = True, config: AllocatorConfig | None = None) -> AllocatorResult:
    """Run an allocation stream (``replay.replay_events``) through the allocator model.

    An allocation freed by the very next event (a kernel's temporary) is a query, not a
    change: when a cached block can hold it, splitting and merging back leave the
    allocator exactly as it was, so only its bytes count toward the allocated peak.
    ``stop_above_bytes``: stop as soon as reserved memory exceeds it (the caller only needs
    to know the plan does not fit); the result then has ``complete`` False.
    ``native``: run the compiled loop (``native_allocator``) when it loads; the Python
    loop below is the reference it must equal (``native=False`` runs it).
    ``config``: allocator settings (``allocator_config``); other than the defaults, the
    Python loop runs (the compiled one knows the default rules only)."""
    config = config or AllocatorConfig()
    if expandable_segments or config.expandable_segments:
        return _expandable(signed_sizes)
    allocator = CachingAllocator(capacity_bytes, config)
    compiled = native_allocator.load() if native and config.default_rules else None
    if compiled is not None:
        return AllocatorResult(*compiled(
            signed_sizes, rows, (MIN_BLOCK, SMALL_SIZE, SMALL_BUFFER, LARGE_BUFFER,
                                 MIN_LARGE_ALLOC, ROUND_LARGE),
            allocator.capacity, stop_above_bytes))
    live: dict[int, _Block] = {}
    magnitude = np.abs(signed_sizes).round().astype(np.int64)
    if config.default_rules:
        # up to a whole block (MIN_BLOCK a power of two: a mask, not a division), at least one
        rounded = np.maximum((magnitude + (MIN_BLOCK - 1)) & -MIN_BLOCK, MIN_BLOCK)
    else:
        rounded = np.array([config.round_size(int(m)) for m in magnitude], dtype=np.int64)
    is_alloc = signed_sizes > 0
    # kind per event: 0 free, 1 alloc, 2 alloc freed by the next event (the free is dropped)
    kind = is_alloc.astype(np.int8)
    if len(rows) > 1:
        pair = is_alloc[:-1] & ~is_alloc[1:] & (rows[:-1] == rows[1:])
        kind[:-1][pair] = 2
        keep = np.ones(len(rows), bool)
        keep[1:][pair] = False
        kind, rows, rounded = kind[keep], rows[keep], rounded[keep]
    small_request = rounded <= SMALL_SIZE
    free_lists = allocator.free_lists
    complete = True
    for what, row, size, small in zip(kind.tolist(), rows.tolist(), rounded.tolist(),
                                      small_request.tolist()):
        if what == 0:
            block = live.pop(row, None)
            if block is not None:
                allocator.free(block)
            continue
        if what == 2:
            items = free_lists[small]
            if items and items[-1][0] >= size and allocator._usable(
                    items, bisect.bisect_left(items, (size, -1, -1)), size):
                # best fit, split, free, merge: the free lists end as they began
                if allocator.allocated + items[-1][0] > allocator.peak_allocated:
                    block_size = items[bisect.bisect_left(items, (size, -1, -1))][0]
                    remaining = block_size - size
                    taken = size if allocator.splits(size, remaining, small) else block_size
                    if allocator.allocated + taken > allocator.peak_allocated:
                        allocator.peak_allocated = allocator.allocated + taken
                continue
            allocator.free(allocator.malloc_rounded(size, small))
        else:
            live[row] = allocator.malloc_rounded(size, small)
        if stop_above_bytes and allocator.reserved > stop_above_bytes:
            complete = False
            break
    return AllocatorResult(allocator.peak_allocated, allocator.peak_reserved,
                           len(allocator.segment_sizes), allocator.out_of_memory, complete)


def _expandable(signed_sizes: np.ndarray) -> AllocatorResult:
    sizes = np.abs(signed_sizes).round().astype(np.int64)
    rounded = np.where(sizes < MIN_BLOCK, MIN_BLOCK, -(-sizes // MIN_BLOCK) * MIN_BLOCK)
    signed = np.where(signed_sizes > 0, rounded, -rounded)
    small = rounded <= SMALL_SIZE
    reserved = 0
    peak_allocated = int(np.cumsum(signed).max()) if len(signed) else 0
    for mask, page in ((small, SMALL_BUFFER), (~small, LARGE_BUFFER)):
        if mask.any():
            live = np.cumsum(np.where(mask, signed, 0)).max()
            reserved += int(-(-live // page) * page)
    return AllocatorResult(peak_allocated, reserved, 2)
