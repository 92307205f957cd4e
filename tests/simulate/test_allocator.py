import numpy as np

from memadvisor.simulate.allocator import (
    CachingAllocator, LARGE_BUFFER, SMALL_BUFFER, replay, round_size, segment_size)

MiB = 1 << 20


def test_rounding_and_segment_sizes():
    assert round_size(1) == 512 and round_size(513) == 1024 and round_size(4096) == 4096
    assert segment_size(512) == SMALL_BUFFER
    assert segment_size(MiB + 512) == LARGE_BUFFER
    assert segment_size(12 * MiB + 1) == 14 * MiB


def test_small_requests_share_one_segment_and_split():
    alloc = CachingAllocator()
    blocks = [alloc.malloc(1000) for _ in range(4)]
    assert alloc.reserved == SMALL_BUFFER
    assert alloc.allocated == 4 * 1024
    assert len({b.segment for b in blocks}) == 1


def test_free_blocks_merge_and_are_reused_best_fit():
    alloc = CachingAllocator()
    a, b, _c = alloc.malloc(3 * MiB), alloc.malloc(3 * MiB), alloc.malloc(3 * MiB)
    assert alloc.reserved == LARGE_BUFFER
    alloc.free(a)
    alloc.free(b)  # merges with a: one 6 MiB free block at the segment start
    d = alloc.malloc(5 * MiB)
    assert d.offset == 0 and alloc.reserved == LARGE_BUFFER
    # remainder of 1 MiB is not > 1 MiB: the large pool does not split it
    assert d.size == 6 * MiB


def test_large_remainder_split_and_new_segment_when_no_fit():
    alloc = CachingAllocator()
    alloc.malloc(12 * MiB)  # its own 12 MiB segment
    alloc.malloc(15 * MiB)
    assert alloc.reserved == 12 * MiB + 16 * MiB


def test_replay_reports_allocated_and_reserved_peaks():
    sizes = np.array([1000.0, 3 * MiB, -1000.0, -3 * MiB, 3 * MiB])
    rows = np.array([0, 1, 0, 1, 2])
    result = replay(sizes, rows)
    assert result.peak_allocated_bytes == 1024 + 3 * MiB
    assert result.peak_reserved_bytes == SMALL_BUFFER + LARGE_BUFFER
    expandable = replay(sizes, rows, expandable_segments=True)
    assert expandable.peak_reserved_bytes == SMALL_BUFFER + LARGE_BUFFER


def test_capacity_releases_cached_segments_before_reporting_oom():
    alloc = CachingAllocator(capacity_bytes=40 * MiB)
    block = alloc.malloc(30 * MiB)
    alloc.free(block)
    alloc.malloc(36 * MiB)  # the cached 30 MiB segment is released first
    assert not alloc.out_of_memory and alloc.reserved == 36 * MiB


def _event_by_event(sizes, rows):
    """The allocator driven one event at a time, without replay's shortcuts."""
    alloc, live = CachingAllocator(), {}
    for delta, row in zip(sizes.tolist(), rows.tolist()):
        if delta > 0:
            live[row] = alloc.malloc(int(round(delta)))
        else:
            alloc.free(live.pop(row))
    return alloc.peak_allocated, alloc.peak_reserved


def test_replay_shortcuts_match_event_by_event():
    # kernel temporaries (an alloc freed by the next event) are replayed as queries:
    # the peaks must be those of the plain event-by-event model
    rng = np.random.default_rng(0)
    for trial in range(30):
        sizes, rows, live, next_row = [], [], [], 0
        for _ in range(400):
            choice = rng.random()
            if live and choice < 0.35:
                row, size = live.pop(int(rng.integers(len(live))))
                sizes.append(-size)
                rows.append(row)
                continue
            size = float(rng.choice([700, 4096, 300_000, 900_000, 3 * MiB, 12 * MiB, 25 * MiB]))
            size *= float(rng.uniform(0.5, 1.5))
            sizes.append(size)
            rows.append(next_row)
            if choice < 0.6:  # a temporary freed at once
                sizes.append(-size)
                rows.append(next_row)
            else:
                live.append((next_row, size))
            next_row += 1
        sizes, rows = np.array(sizes), np.array(rows)
        result = replay(sizes, rows)
        assert (result.peak_allocated_bytes, result.peak_reserved_bytes) == \
            _event_by_event(sizes, rows), trial


def test_replay_stops_once_reserved_passes_the_limit():
    sizes = np.array([30.0 * MiB, 30.0 * MiB, 30.0 * MiB])
    rows = np.array([0, 1, 2])
    result = replay(sizes, rows, stop_above_bytes=50 * MiB)
    assert not result.complete and result.peak_reserved_bytes == 60 * MiB
    assert replay(sizes, rows).complete
