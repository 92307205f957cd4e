"""The staging buffers of CUDA reductions, which fake execution adds.

torch's CUDA reduction kernel (aten/src/ATen/native/cuda/Reduce.cuh, ``gpu_reduce_kernel``)
splits a long reduction across thread blocks when each output has many inputs and there
are few outputs ("global reduce"): it then takes a staging buffer of
``sizeof(acc) * outputs * ctas_per_output`` bytes (times ``block.x * output_vec_size``
when the reduced dimension is not the fastest-moving one) and a semaphore array of
``4 * grid.x`` bytes from the caching allocator, for the kernel's duration.  Which
configuration it picks (``setReduceConfig``) depends only on the shapes, strides, dtype
and the GPU's SM count and threads per SM, so it is ported here.  The largest case in
training is a bias gradient: ``grad.sum(0)`` over (batch x tokens, features).  Measured on
an H100 (torch 2.11, 2026-11-25), ViT at 224 px (12,608 rows): features 1,536 ->
138,412,032 B, 1,152 -> 116,195,328 B, 384 -> 38,731,776 B, each exactly this port's
figure; leaving them out under-predicted that step's peak allocated by 2.1%.

Covered: ``sum`` and ``mean`` (whole tensor or over dims) whose accumulator is fp32 or
fp64.  Not covered: Welford reductions (var/std), norms, arg-reductions, and tensors over
2**31 elements (split into 32-bit-indexed pieces).
"""
from __future__ import annotations

import torch

from ..trace import schema

REDUCTION_OPS = frozenset({"aten::sum", "aten::mean"})
BUFFER_OP = "reduction_staging"
WARP_SIZE = 32
INPUT_VEC_SIZE = 4
VT0 = 4  #: values per thread unrolled (gpu_reduce_kernel's default)
MIN_VALUES_PER_THREAD = 16
MAX_VALUES_PER_THREAD = 256


def max_threads_per_sm(capability: tuple[int, int]) -> int:
    """``maxThreadsPerMultiProcessor`` by compute capability (CUDA's occupancy tables)."""
    if capability in ((8, 6), (8, 7), (8, 9)):
        return 1536
    if capability == (7, 5):
        return 1024
    return 2048


def _last_pow2(n: int) -> int:
    """floor(2 ** log2(n)), at least 1 (Reduce.cuh's last_pow2)."""
    return max(1, 1 << (max(1, n).bit_length() - 1))


def _iteration_dims(shape, strides, reduced):
    """TensorIterator's view of a reduction: size-1 dims dropped, reduced dims moved to
    the front, each group ordered fastest-moving first, adjacent dims coalesced where the
    strides allow.  Returns (sizes, input strides in elements, number of reduced dims)."""
    dims = [(int(size), int(stride), d in reduced)
            for d, (size, stride) in enumerate(zip(shape, strides)) if size != 1]
    dims.sort(key=lambda dim: (not dim[2], dim[1]))
    merged: list[list] = []
    for size, stride, is_reduced in dims:
        last = merged[-1] if merged else None
        if last is not None and last[2] == is_reduced and stride == last[1] * last[0]:
            last[0] *= size
        else:
            merged.append([size, stride, is_reduced])
    return ([d[0] for d in merged], [d[1] for d in merged],
            sum(1 for d in merged if d[2]))


def staging_bytes(shape, strides, dims, accumulator_bytes: int, sm_count: int,
                  threads_per_sm: int) -> tuple[int, int]:
    """(staging buffer bytes, semaphore bytes) of a reduction of a tensor of ``shape`` and
    ``strides`` (elements) over ``dims`` (all when empty); (0, 0) when it needs none."""
    ndim = len(shape)
    reduced = {d % ndim for d in dims} if dims else set(range(ndim))
    sizes, in_strides, num_reduce_dims = _iteration_dims(shape, strides, reduced)
    numel = 1
    for size in shape:
        numel *= int(size)
    num_outputs = 1
    for d, size in enumerate(shape):
        if d not in reduced:
            num_outputs *= int(size)
    if numel == 0 or num_outputs == 0 or not sizes:
        return 0, 0
    inputs_per_output = numel // num_outputs
    fastest_is_reduced = num_reduce_dims == len(sizes) or (
        num_reduce_dims > 0 and in_strides[0] < in_strides[num_reduce_dims])
    if num_reduce_dims == 0:
        return 0, 0  # nothing reduced: a copy
    output_vec_size = 1
    if fastest_is_reduced:
        dim0, dim1, fastest_stride = inputs_per_output, num_outputs, in_strides[0]
    else:
        dim0, dim1 = num_outputs, inputs_per_output
        fastest_stride = in_strides[num_reduce_dims]
    if fastest_stride == 1:
        if fastest_is_reduced and dim0 > 128 and num_reduce_dims == 1 and VT0 >= INPUT_VEC_SIZE:
            dim0 //= INPUT_VEC_SIZE
        elif not fastest_is_reduced:
            output_vec_size = 4  # get_output_vec_size: 4, halved until everything divides
            checks = [sizes[num_reduce_dims]] + [s for i, s in enumerate(in_strides)
                                                if i != num_reduce_dims]
            while any(value % output_vec_size for value in checks):
                output_vec_size //= 2
            dim0 //= output_vec_size
    max_threads = 512 // output_vec_size
    dim0_pow2 = _last_pow2(dim0) if dim0 < max_threads else max_threads
    dim1_pow2 = _last_pow2(dim1) if dim1 < max_threads else max_threads
    block_width = min(dim0_pow2, WARP_SIZE)
    block_height = min(dim1_pow2, max_threads // block_width)
    block_width = min(dim0_pow2, max_threads // block_height)
    num_threads = block_width * block_height
    step_input = step_output = 1
    block_x_reduce = fastest_is_reduced
    if block_x_reduce:
        step_input *= block_width
    else:
        step_output *= block_width
    values_per_thread = -(-inputs_per_output // step_input)
    block_y_reduce = (values_per_thread >= block_height * 16
                      or values_per_thread >= MAX_VALUES_PER_THREAD)
    if block_y_reduce:
        step_input *= block_height
    else:
        step_output *= block_height
    target_grid = sm_count * (threads_per_sm // num_threads)
    grid_x = -(-(num_outputs // output_vec_size) // step_output)
    values_per_thread = -(-inputs_per_output // step_input)
    if not (block_y_reduce and values_per_thread >= MAX_VALUES_PER_THREAD
            and grid_x <= target_grid):
        return 0, 0
    ctas = max(min(-(-target_grid // grid_x), -(-values_per_thread // MIN_VALUES_PER_THREAD)),
               -(-values_per_thread // MAX_VALUES_PER_THREAD))
    if ctas <= 1:
        return 0, 0
    size = accumulator_bytes * num_outputs * ctas
    if not block_x_reduce:
        size *= block_width * output_vec_size
    return size, 4 * grid_x


class ReductionBuffers:
    """Adds each global-reduce staging buffer and semaphore array as transient
    'temporary' blocks after the reduction's output (freed at the kernel's end)."""

    def __init__(self, sm_count: int, capability: tuple[int, int]):
        self.sm_count = sm_count
        self.threads_per_sm = max_threads_per_sm(capability)
        self._session = None
        self.made = 0

    def attach(self, session) -> None:
        self._session = session

    def after_op(self, op_name: str, args, out) -> None:
        if op_name not in REDUCTION_OPS or not args:
            return
        source = args[0]
        if not isinstance(source, torch.Tensor) or source.device.type != "cuda" \
                or source.dim() == 0 or source.is_complex():
            return
        dims = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
        accumulator_bytes = 8 if source.dtype == torch.float64 else 4
        if not (source.is_floating_point() or accumulator_bytes == 8):
            return  # integer sums accumulate in int64 through another path
        buffer_bytes, semaphore_bytes = staging_bytes(
            source.shape, source.stride(), dims, accumulator_bytes, self.sm_count,
            self.threads_per_sm)
        if not buffer_bytes:
            return
        self._session.recorder.kernel_scratch(
            (buffer_bytes, semaphore_bytes), f"cuda:{source.device.index or 0}", BUFFER_OP,
            self._session.locator.locate(3), schema.TEMPORARY)
        self.made += 1
