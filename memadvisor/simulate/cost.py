"""Step-time cost of a plan relative to the baseline step, with every term named.

Baseline time ``T``: the analysed step's measured duration when the target is the device
that recorded the trace; otherwise the trace's FLOPs at the target's datasheet rate times
``MATMUL_EFFICIENCY``.  The throughput the step reached (FLOPs / T) prices extra work:

* recompute: forward FLOPs of the checkpointed modules (``op_stats``), once more, at the
  rate the plan's matmuls run (the 16-bit tensor rate under ``amp-*`` / ``bf16`` on a GPU);
* precision: on a GPU target, matmul/convolution FLOPs run at the bf16/fp16 tensor rate
  (``amp-*``, ``bf16``); on CPU no speed-up is assumed;
* data parallel: each rank computes ``1/world`` of the batch; communication per step
  (``sharding.communication_bytes``: FSDP's collectives repeat every micro-step) at the
  interconnect bandwidth, overlapped with backward compute (gradient collectives) and
  forward compute (zero3 gathers);
* offload: one rank's host-link bytes at the host bandwidth (its shard of the model state;
  every activation ``save_on_cpu`` moves, to the host and back, each micro-step), half
  hidden behind compute (copies and compute overlap; ZeRO-Offload reports ~1.5x over
  serial), plus the host optimizer step over the rank's parameters;
* accumulation: the same FLOPs in ``accum`` smaller launches, ``ACCUM_OVERHEAD`` of the
  step per extra micro-step (an assumption, printed).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..plan import FSDP_SHARDS, Plan
from ..units import format_bytes
from .hardware import LINK_EFFICIENCY, MATMUL_EFFICIENCY, Hardware
from .module_paths import inside_any
from .offload import host_link_bytes
from .sharding import communication_bytes

MATMUL_OPS = ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "conv", "attention")
ACCUM_OVERHEAD = 0.02  #: per extra micro-step: launch overhead and lower utilisation
OFFLOAD_OVERLAP = 0.5  #: fraction of host-link time hidden behind compute


@dataclass
class WorkProfile:
    """What the cost model needs from a trace, computed once."""

    step_time_s: float
    forward_flops: float
    backward_flops: float
    matmul_flops: float
    module_forward_flops: dict[str, float] = field(default_factory=dict)
    measured_on: str = "cpu"
    #: forward FLOPs per tuple of checkpointed regions (memo: advise asks per plan)
    region_flops: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def total_flops(self) -> float:
        return self.forward_flops + self.backward_flops


def work_profile(meta, steps_recorded: int) -> WorkProfile:
    """Sum ``op_stats`` (recorded over all steps) and scale to one step."""
    steps = max(steps_recorded, 1)
    forward = backward = matmul = 0.0
    per_module: dict[str, float] = {}
    for stat in meta.op_stats:
        flops = float(stat.get("flops") or 0) / steps
        if not flops:
            continue
        if stat.get("phase") == "forward":
            forward += flops
            per_module[stat.get("module", "")] = per_module.get(stat.get("module", ""), 0) + flops
        elif stat.get("phase") == "backward":
            backward += flops
        if any(key in str(stat.get("op", "")) for key in MATMUL_OPS):
            matmul += flops
    steps_info = meta.steps
    duration = float(steps_info[-1]["duration_s"]) if steps_info else 0.0
    return WorkProfile(duration, forward, backward, matmul, per_module,
                       "cuda" if str(meta.device).startswith("cuda") else "cpu")


_LINEAR_OPS = ("aten::addmm", "aten::mm", "aten::linear", "aten::matmul", "aten::bmm")
_CONV_OPS = ("aten::convolution", "aten::_convolution", "aten::mkldnn_convolution",
             "aten::cudnn_convolution", "aten::conv2d", "aten::conv1d", "aten::conv3d")
_ATTENTION = "scaled_dot_product"


def flops_from_shapes(timeline, meta) -> dict[str, float]:
    """Forward FLOPs per module estimated from output shapes, for traces whose
    ``op_stats`` carry no FLOPs: a Linear/Conv output of ``n`` positions costs
    2 x n x (the module's own parameters); attention (B, H, T, D) costs 4 x B x H x T^2 x D.
    Each module's rows are summed in row order (``np.add.accumulate``)."""
    import numpy as np
    import pandas as pd

    from ..trace import schema
    from .replay import PHASE_CODE

    owned = {m["path"]: int(m.get("parameter_count", 0)) for m in meta.modules}
    forward = np.flatnonzero((timeline.phase == PHASE_CODE[schema.FORWARD])
                             & (timeline.alloc_key >= 0))
    shape_codes, shapes = pd.factorize(timeline.shape[forward])
    # one figure per distinct (op, module, shape): rows only look it up
    ops = timeline.op[forward].astype(np.int64)
    modules = timeline.module[forward].astype(np.int64)
    width = len(shapes) + 1
    inverse, combos = pd.factorize((ops * (len(timeline.modules) + 1) + modules) * width
                                   + shape_codes + 1)
    figures = np.array([_shape_flops(timeline.ops[int(ops[row])],
                                     timeline.modules[int(modules[row])],
                                     shapes[shape_codes[row]] if shape_codes[row] >= 0
                                     else None, owned)
                        for row in _first_rows(inverse, len(combos))] or [0.0])
    flops = figures[inverse] if len(forward) else np.zeros(0)
    rows = np.flatnonzero(flops != 0)
    modules = modules[rows]
    by_module = np.argsort(modules, kind="stable")
    starts = np.flatnonzero(np.diff(modules[by_module], prepend=-1))
    ends = np.append(starts[1:], len(rows))
    first_rows = by_module[starts]  # where each module first appears: the dict's order
    out: dict[str, float] = {}
    for index in np.argsort(first_rows, kind="stable").tolist():
        values = flops[rows[by_module[starts[index]:ends[index]]]]
        out[timeline.modules[int(modules[by_module[starts[index]]])]] = float(
            np.add.accumulate(values)[-1])
    return out


def _first_rows(codes, count: int) -> list[int]:
    """The first row of each code 0..count-1."""
    import numpy as np

    first = np.full(count, len(codes), np.int64)
    np.minimum.at(first, codes, np.arange(len(codes)))
    return first.tolist()


def _shape_flops(op: str, module: str, shape, owned: dict[str, int]) -> float:
    import numpy as np

    dims = [int(d) for d in str(shape).split(",")] if shape else []
    if not dims:
        return 0.0
    numel = float(np.prod(dims))
    if not numel:  # an empty tensor (or a storage resized to nothing)
        return 0.0
    if op in _LINEAR_OPS and owned.get(module):
        return 2.0 * owned[module] * numel / dims[-1]
    if op in _CONV_OPS and owned.get(module) and len(dims) > 1:
        return 2.0 * owned[module] * numel / dims[1]
    if _ATTENTION in str(op) and len(dims) == 4:
        return 4.0 * numel * dims[2]
    return 0.0


def with_shape_flops(work: WorkProfile, per_module: dict[str, float]) -> WorkProfile:
    forward = sum(per_module.values())
    return WorkProfile(work.step_time_s, forward, 2 * forward, 3 * forward, per_module,
                       work.measured_on)


def region_forward_flops(work: WorkProfile, regions: list[str]) -> float:
    key = tuple(regions)
    if key not in work.region_flops:
        work.region_flops[key] = _region_forward_flops(work, regions)
    return work.region_flops[key]


def _region_forward_flops(work: WorkProfile, regions: list[str]) -> float:
    modules = list(work.module_forward_flops)
    inside = inside_any(modules, regions)
    return float(sum(flops for flops, hit in zip(work.module_forward_flops.values(), inside)
                     if hit))


def _flop_text(flops: float) -> str:
    for scale, unit in ((1e12, "TFLOP"), (1e9, "GFLOP"), (1e6, "MFLOP"), (1e3, "kFLOP")):
        if flops >= scale:
            return f"{flops / scale:.3g} {unit}"
    return f"{flops:.3g} FLOP"


@dataclass
class Cost:
    baseline_step_s: float
    step_time_s: float
    terms: list[tuple[str, float]]  #: (what, seconds added (+) or saved (-))
    assumptions: list[str]

    @property
    def step_time_factor(self) -> float:
        return self.step_time_s / self.baseline_step_s if self.baseline_step_s > 0 else 1.0


def estimate(plan: Plan, work: WorkProfile, hw: Hardware, regions: list[str],
             parameter_bytes: float, gradient_bytes: float, offloaded_activation_bytes: float,
             parameter_count: float) -> Cost:
    """``offloaded_activation_bytes``: what ``save_on_cpu`` moves per micro-step;
    ``parameter_count``: the model's parameters (the host optimizer steps a rank's share)."""
    assumptions = []
    same_device = hw.device_type == work.measured_on and (
        hw.name == "cpu" or work.measured_on == "cuda")
    if same_device and work.step_time_s > 0:
        base = work.step_time_s
        throughput = work.total_flops / base if base > 0 else hw.fp32_flops
        assumptions.append(f"baseline step {base * 1e3:.1f} ms as measured")
    else:
        throughput = hw.fp32_flops * MATMUL_EFFICIENCY
        base = max(work.total_flops / throughput, 1e-6)
        assumptions.append(
            f"baseline step {base * 1e3:.3g} ms estimated: {_flop_text(work.total_flops)} "
            f"at {MATMUL_EFFICIENCY:.0%} of {hw.fp32_flops / 1e12:.3g} TFLOP/s fp32")
    terms: list[tuple[str, float]] = []
    compute = base
    matmul_rate = throughput  # what the checkpointed modules' matmuls run at once more
    if plan.precision != "fp32" and hw.device_type == "cuda" and throughput > 0:
        matmul_rate = hw.bf16_flops * MATMUL_EFFICIENCY
        matmul_time = work.matmul_flops / throughput
        fast = work.matmul_flops / matmul_rate
        saved = max(matmul_time - fast, 0.0)
        terms.append((f"{plan.precision}: matmuls at the 16-bit tensor rate", -saved))
        compute -= saved
    if regions:
        flops = region_forward_flops(work, regions)
        recompute = flops / matmul_rate if matmul_rate > 0 else 0.0
        terms.append((f"recompute forward of {len(regions)} checkpointed module(s), "
                      f"{_flop_text(flops)}", recompute))
        compute += recompute
    if plan.accum > 1:
        penalty = compute * ACCUM_OVERHEAD * (plan.accum - 1)
        terms.append((f"{plan.accum} micro-batches: smaller kernels, "
                      f"{ACCUM_OVERHEAD:.0%} per extra micro-step", penalty))
        assumptions.append(f"each extra micro-step costs {ACCUM_OVERHEAD:.0%} of the step")
        compute += penalty
    if plan.world > 1:
        per_rank = compute / plan.world
        terms.append((f"compute split over {plan.world} ranks", per_rank - compute))
        compute = per_rank
    total = compute
    volume = communication_bytes(plan, parameter_bytes, gradient_bytes)
    if volume:
        link = hw.interconnect_bytes_s * LINK_EFFICIENCY
        comm = volume / link
        backward_share = work.backward_flops / work.total_flops if work.total_flops else 0.5
        hidden = compute * (backward_share if plan.shard != "zero3" else 1.0)
        exposed = max(comm - hidden, 0.0)
        terms.append((f"{plan.shard} communication {format_bytes(volume)}/step at "
                      f"{link / 1e9:.3g} GB/s, {comm * 1e3:.3g} ms ({exposed * 1e3:.3g} ms "
                      "not hidden behind compute)", exposed))
        total += exposed
        assumptions.append(f"collectives reach {LINK_EFFICIENCY:.0%} of the link bandwidth")
    traffic = host_link_bytes(plan, parameter_bytes, gradient_bytes, offloaded_activation_bytes)
    if traffic:
        copy = traffic / hw.host_link_bytes_s
        exposed = copy * (1 - OFFLOAD_OVERLAP)
        terms.append((f"offload traffic {format_bytes(traffic)}/step over the host link "
                      f"({hw.host_link_bytes_s / 1e9:.3g} GB/s)", exposed))
        total += exposed
        assumptions.append(f"{OFFLOAD_OVERLAP:.0%} of host copies overlap compute")
    if "optimizer" in plan.offload:
        # under FSDP each rank steps its own shard (FSDP2 CPUOffloadPolicy)
        params = parameter_count / (plan.shard_group_size if plan.shard in FSDP_SHARDS else 1)
        host_step = params / hw.host_adam_params_s
        per_rank = " per rank" if plan.shard in FSDP_SHARDS else ""
        terms.append((f"optimizer step on the host ({params / 1e6:.2f} M parameters"
                      f"{per_rank})", host_step))
        total += host_step
    return Cost(base, total, terms, assumptions)
