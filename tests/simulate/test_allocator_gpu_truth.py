"""The allocator model against real GPUs: the recorded request streams of three real CUDA
snapshots (tests/fixtures/gpu_truth, MIT), replayed from their recorded starting state,
give the recorded reserved bytes and segment counts."""
from __future__ import annotations

import pytest

from memadvisor.errors import UserError
from memadvisor.simulate.allocator import CachingAllocator, replay
from memadvisor.simulate.allocator_config import (
    AllocatorConfig, config_from_snapshot, parse_alloc_conf)
from memadvisor.simulate.recorded_state import replay_recorded
from memadvisor.trace import read_trace

from ..snapshot.conftest import W_SNAPSHOTS, imported  # noqa: F401  (session fixture)

MiB = 2**20


def test_model_reproduces_real_reserved_and_segments(imported):  # noqa: F811
    assert len(imported) == len(W_SNAPSHOTS) == 3
    for name, (snapshot, trace_path) in imported.items():
        result = replay_recorded(read_trace(trace_path))
        assert result.requests > 6000
        assert abs(result.reserved_error) <= 0.01, (name, result)
        assert abs(result.segments_error) <= 0.02, (name, result)
        assert result.recorded_segments == len(snapshot["segments"])
        # the model picks its own blocks: allocated may differ only by unsplit remainders
        assert abs(result.modelled_peak_allocated_bytes / result.recorded_peak_allocated_bytes
                   - 1) < 0.001


def test_cold_start_without_the_warm_up_history(imported):  # noqa: F811
    """From nothing cached (as a prediction starts) reserved stays within 1% on these
    warm steps; the segment count is what the unseen warm-up history shapes."""
    for name, (_, trace_path) in imported.items():
        cold = replay_recorded(read_trace(trace_path), cold_start=True)
        assert abs(cold.reserved_error) <= 0.01, (name, cold)


def test_roundup_power2_divisions_as_c10():
    config = parse_alloc_conf("roundup_power2_divisions:4")
    # c10's documented example: 1200 MB with 4 divisions -> the next of 1024, 1280, ...
    assert config.round_size(1200 * MiB) == 1280 * MiB
    assert config.round_size(1024 * MiB) == 1024 * MiB  # a power of two stays
    assert config.round_size(1000) == 1024  # small requests: 512-byte rounding
    per_bucket = parse_alloc_conf("roundup_power2_divisions:[256:1,512:2,>:8]")
    assert per_bucket.round_size(300 * MiB) == 300 * MiB  # 1 division: plain rounding
    assert per_bucket.round_size(600 * MiB) == 768 * MiB  # 512..1024 in 2
    assert per_bucket.round_size(2100 * MiB) == 2304 * MiB  # 2048..4096 in 8
    assert not AllocatorConfig().round_size(1200 * MiB) % 512


def test_max_split_size_keeps_oversize_blocks_whole():
    model = CachingAllocator(config=parse_alloc_conf("max_split_size_mb:64"))
    big = model.malloc(100 * MiB)
    model.free(big)
    # a small large-pool request does not carve the cached 100 MiB block: new segment
    small = model.malloc(30 * MiB)
    assert small.segment != big.segment and len(model.segment_sizes) == 2
    # an oversize request takes a cached block only within 20 MiB of its size
    model.free(small)
    again = model.malloc(90 * MiB)
    assert again.segment == big.segment and again.size == 100 * MiB  # unsplit
    plain = CachingAllocator()
    first = plain.malloc(100 * MiB)
    plain.free(first)
    assert plain.malloc(30 * MiB).segment == first.segment


def test_settings_replay_on_the_python_loop_and_differ():
    sizes = [100 * MiB, -100 * MiB, 30 * MiB, 50 * MiB]
    import numpy as np
    rows = np.array([0, 0, 1, 2])
    default = replay(np.array(sizes, float), rows)
    split_limited = replay(np.array(sizes, float), rows,
                           config=parse_alloc_conf("max_split_size_mb:64"))
    assert split_limited.peak_reserved_bytes > default.peak_reserved_bytes


def test_settings_the_model_cannot_follow_are_refused_by_name():
    for text, word in (("garbage_collection_threshold:0.6", "garbage_collection_threshold"),
                       ("backend:cudaMallocAsync", "cudaMallocAsync"),
                       ("max_split_size_mb:10", "max_split_size_mb"),
                       ("roundup_power2_divisions:3", "power of two"),
                       ("bogus:1", "bogus")):
        with pytest.raises(UserError, match=word):
            parse_alloc_conf(text)
    assert parse_alloc_conf("expandable_segments:True").expandable_segments
    with pytest.raises(UserError, match="garbage_collection_threshold"):
        config_from_snapshot({"garbage_collection_threshold": 0.8})


def test_each_stream_caches_its_own_blocks():
    """A block freed on one stream's pool is not reused by a request on another (FSDP2's
    all-gather stream, DDP's): the caching allocator keys its pools by stream."""
    model = CachingAllocator()
    side = model.malloc(30 * MiB, stream=7)
    model.free(side)
    main = model.malloc(30 * MiB)
    assert main.segment != side.segment and len(model.segment_sizes) == 2
    again = model.malloc(30 * MiB, stream=7)
    assert again.segment == side.segment
