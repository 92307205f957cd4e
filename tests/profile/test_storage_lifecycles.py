"""Storage life cycles a dispatch mode alone would miss or mislabel: ``UntypedStorage.resize_``
(how FSDP2 frees and re-allocates unsharded parameters), kernel-internal blocks, what a
non-reentrant checkpoint keeps for backward, and torch.compile's wrapper names."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from memadvisor.profile.session import ProfileSession
from memadvisor.trace import analysis, schema

FLOAT = 4


def _events(session):
    table, _ = session.build()
    return table.to_pandas()


def test_storage_resize_frees_and_reallocates_like_fsdp(engine):
    with ProfileSession(native_hook=engine == "native") as session:
        unsharded = torch.empty(1000)
        unsharded.untyped_storage().resize_(0)  # FSDP's free_storage after forward
        between = analysis.live_bytes(_events_now(session))[-1]
        unsharded.untyped_storage().resize_(1000 * FLOAT)  # alloc_storage before all-gather
        after = analysis.live_bytes(_events_now(session))[-1]
    assert between == 0
    assert after == 1000 * FLOAT
    events = _events(session)
    resize = events[events["op"] == "UntypedStorage.resize_"]
    # the shrink is a free of the old size; the regrowth an alloc of the new one
    if engine == "dispatch":
        # the dispatch engine follows the storage object: its 0-byte state is a row too
        assert list(zip(resize["action"], resize["size_bytes"])) == [
            ("alloc", 0), ("free", 0), ("alloc", 4000)]
    else:
        # the native engine follows the allocator's blocks: aten::empty's block is freed,
        # resize_ allocates a new one
        assert list(zip(resize["action"], resize["size_bytes"])) == [("alloc", 4000)]
        empty = events[events["op"] == "aten::empty"]
        assert list(zip(empty["action"], empty["size_bytes"])) == [
            ("alloc", 4000), ("free", 4000)]
    assert torch.UntypedStorage.resize_ is torch._C.StorageBase.resize_  # patch undone


def _events_now(session):
    return session.recorder.to_table([]).to_pandas()


def test_kernel_internal_blocks_are_raw_bytes_freed_by_their_op():
    conv = nn.Conv2d(16, 32, 3, padding=1)
    x = torch.randn(8, 16, 32, 32)
    with ProfileSession() as session:
        with torch.no_grad():
            conv(x)
    if session.native_status != "on":
        import pytest
        pytest.skip(f"native allocator hook {session.native_status}")
    events = _events(session)
    internal = events[events["dtype"] == schema.RAW_BYTES_DTYPE]
    assert len(internal), "oneDNN convolution allocates scratch inside its kernel"
    lives = analysis.lifetimes(events)
    blocks = lives[lives["dtype"] == schema.RAW_BYTES_DTYPE]
    # every scratch block is made and freed inside aten::convolution
    assert set(blocks["op"].astype(str)) == {"aten::convolution"}
    assert (blocks["free_pos"] < len(events)).all()
    assert (blocks["shape"].astype(str) == blocks["size_bytes"].astype(str)).all()


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 128)
        self.fc2 = nn.Linear(128, 32)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class _Net(nn.Module):
    def __init__(self, use_checkpoint: bool):
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(3))
        self.use_checkpoint = use_checkpoint

    def forward(self, x):
        for block in self.blocks:
            # preserve_rng_state=False: the CPU RNG state it would keep per block (5 KB, as
            # big as this toy block's activations) is not what this test is about
            x = checkpoint(block, x, use_reentrant=False, preserve_rng_state=False) \
                if self.use_checkpoint else block(x)
        return x


def _activation_peak(use_checkpoint: bool) -> tuple[int, set[int]]:
    torch.manual_seed(0)
    model = _Net(use_checkpoint)
    x = torch.randn(16, 32)
    with ProfileSession() as session:
        model(x).pow(2).mean().backward()
    events = _events(session)
    series = analysis.category_series(events, schema.ACTIVATION)
    kept = events[(events["category"] == schema.ACTIVATION) & (events["action"] == "alloc")]
    return int(series.max()), set(kept["size_bytes"].astype(int))


def test_what_a_checkpoint_keeps_for_backward_is_activation():
    full, _ = _activation_peak(False)
    kept, sizes = _activation_peak(True)
    # a non-reentrant checkpoint hides its saves from our pack hook; the block inputs it
    # holds from forward into backward are activations all the same
    assert kept > 0
    assert 16 * 32 * FLOAT in sizes
    assert kept < full / 2, (kept, full)


def test_torch_compile_wrapper_keeps_the_users_module_names():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    compiled = torch.compile(model, backend="eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with ProfileSession() as session:
        for _ in range(2):
            compiled(torch.randn(4, 8)).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    events = _events(session)
    modules = set(events["module"].astype(str))
    assert not any("_orig_mod" in m for m in modules), modules
    params = events[(events["category"] == schema.PARAMETER) & (events["action"] == "alloc")]
    assert set(params["module"].astype(str)) == {"0", "2"}
    assert np.isclose(float(params["size_bytes"].sum()), (8 * 16 + 16 + 16 + 1) * FLOAT)
