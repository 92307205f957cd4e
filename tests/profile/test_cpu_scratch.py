"""profile/cpu_scratch.py: a fake CPU op's real kernel blocks, measured once per signature."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memadvisor.profile import cpu_scratch
from memadvisor.profile.cpu_scratch import CpuKernelBlocks, _blocks, run_threads


def test_blocks_keep_the_allocators_order_and_drop_what_outlives_the_kernel():
    # scratch A, the output at X, A freed, scratch B still held when the kernel returned
    kinds = [1, 1, -1, 1]
    ptrs = [100, 200, 100, 300]
    sizes = [64, 32, 0, 16]
    assert _blocks(kinds, ptrs, sizes, {200: 0}) == ((1, "b0", 64), (1, 0, 32), (-1, "b0", 0))


def test_an_address_serving_scratch_then_the_output_is_the_output_last():
    kinds, ptrs, sizes = [1, -1, 1], [100, 100, 100], [48, 0, 40]
    assert _blocks(kinds, ptrs, sizes, {100: 0}) == ((1, "b0", 48), (-1, "b0", 0), (1, 0, 40))


def test_torchrun_ranks_run_one_thread_unless_the_user_says_otherwise():
    assert run_threads(2, environ={}) == 1
    assert run_threads(2, environ={"OMP_NUM_THREADS": "2"}) == torch.get_num_threads()
    assert run_threads(1, environ={}) == torch.get_num_threads()


def _hook():
    from memadvisor.profile.native import AllocatorHook, NativeHookUnavailable
    try:
        return AllocatorHook.load()
    except NativeHookUnavailable as exc:
        pytest.skip(f"native hook unavailable: {exc.reason}")


def test_a_signature_is_measured_once_and_reused():
    blocks = CpuKernelBlocks(_hook(), threads=1)
    conv = torch.ops.aten.convolution.default
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.zeros(2, 3, 16, 16))
        w = mode.from_tensor(torch.zeros(8, 3, 3, 3))
        args = (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
        out = conv(*args)
        first = blocks(conv, args, {}, out)
        again = blocks(conv, args, {}, conv(*args))
    assert first is again and blocks.measured == 1
    # the output is among the blocks, with at least its storage's bytes
    output_bytes = [size for kind, slot, size in first if slot == 0]
    assert output_bytes and output_bytes[0] >= 2 * 8 * 16 * 16 * 4
    assert blocks.summary()["output_mismatches"] == {}


def test_ops_with_value_dependent_outputs_are_not_measured():
    blocks = CpuKernelBlocks(_hook(), threads=1)
    nonzero = torch.ops.aten.nonzero.default
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        x = mode.from_tensor(torch.zeros(4))
        assert blocks(nonzero, (x,), {}, None) is None
    assert blocks.measured == 0


def test_inputs_over_the_limit_are_not_run(monkeypatch):
    monkeypatch.setattr(cpu_scratch, "MAX_PROBE_ELEMENTS", 10)
    blocks = CpuKernelBlocks(_hook(), threads=1)
    add = torch.ops.aten.add.Tensor
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.zeros(16))
        assert blocks(add, (x, x), {}, add(x, x)) is None
    assert blocks.measured == 0
