"""Hardware profiles (chosen by name) and the device-dependent rules, in one table.

A profile gives what the cost model and the feasibility checks need: memory, whether
bf16/fp16 run natively, dense matmul throughput, memory bandwidth, the GPU-to-GPU link
and the host link.  Figures are the vendors' datasheet numbers (dense, no sparsity); the
cost model applies ``MATMUL_EFFICIENCY`` and ``LINK_EFFICIENCY`` on top and prints both.

Device rules (which ops autocast runs in low precision, whether the optimizer uses
``foreach`` temporaries, the dropout mask dtype) depend on the *target* device type, not
on the machine that recorded the trace, and are kept in ``DEVICE_RULES`` so a rule
validated on a GPU is added in one place.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .. import gpus
from ..errors import UserError

GiB = 1024**3
MATMUL_EFFICIENCY = 0.5  #: fraction of datasheet FLOP/s a training step reaches
LINK_EFFICIENCY = 0.7  #: fraction of datasheet link bandwidth collectives reach


@dataclass(frozen=True, kw_only=True, slots=True)
class Hardware:
    name: str
    device_type: str  #: 'cuda' or 'cpu'
    memory_bytes: int
    bf16: bool
    fp16: bool
    fp32_flops: float  #: dense FP32 FLOP/s (TF32 off)
    bf16_flops: float  #: dense BF16/FP16 tensor FLOP/s
    memory_bandwidth_bytes_s: float
    interconnect_bytes_s: float  #: per-GPU bandwidth to the other GPUs (NVLink or PCIe)
    host_link_bytes_s: float  #: GPU <-> host (PCIe), each direction
    host_adam_params_s: float = 1.0e9  #: parameters/s a host (CPU) Adam step updates
    #: (major, minor) from ``memadvisor.gpus``; (0, 0) for the CPU
    compute_capability: tuple[int, int] = (0, 0)

    def describe(self) -> str:
        if self.device_type == "cpu":
            return ("cpu (the recording machine): memory limited by the budget only, speed "
                    "from the trace's measured step time")
        return (f"{self.name}: {self.memory_bytes / GiB:.0f} GiB, bf16 "
                f"{'yes' if self.bf16 else 'no'}, {self.bf16_flops / 1e12:.0f} TFLOP/s bf16, "
                f"{self.fp32_flops / 1e12:.0f} TFLOP/s fp32, GPU link "
                f"{self.interconnect_bytes_s / 1e9:.0f} GB/s, host link "
                f"{self.host_link_bytes_s / 1e9:.0f} GB/s")


#: throughputs per GPU; memory and compute capability come from ``memadvisor.gpus``
#: (``_with_identity``), the one table of what each device is
PROFILES: dict[str, Hardware] = {h.name: h for h in (
    Hardware(name="h100-80gb", device_type="cuda", memory_bytes=0, bf16=True, fp16=True,
             fp32_flops=67e12, bf16_flops=989e12, memory_bandwidth_bytes_s=3.35e12,
             interconnect_bytes_s=450e9, host_link_bytes_s=64e9),
    Hardware(name="h200-141gb", device_type="cuda", memory_bytes=0, bf16=True,
             fp16=True, fp32_flops=67e12, bf16_flops=989e12,
             memory_bandwidth_bytes_s=4.8e12, interconnect_bytes_s=450e9,
             host_link_bytes_s=64e9),
    Hardware(name="a100-80gb", device_type="cuda", memory_bytes=0, bf16=True, fp16=True,
             fp32_flops=19.5e12, bf16_flops=312e12, memory_bandwidth_bytes_s=2.0e12,
             interconnect_bytes_s=300e9, host_link_bytes_s=32e9),
    Hardware(name="a100-40gb", device_type="cuda", memory_bytes=0, bf16=True, fp16=True,
             fp32_flops=19.5e12, bf16_flops=312e12, memory_bandwidth_bytes_s=1.56e12,
             interconnect_bytes_s=300e9, host_link_bytes_s=32e9),
    Hardware(name="l4-24gb", device_type="cuda", memory_bytes=0, bf16=True, fp16=True,
             fp32_flops=30e12, bf16_flops=121e12, memory_bandwidth_bytes_s=0.3e12,
             interconnect_bytes_s=32e9, host_link_bytes_s=32e9),
    Hardware(name="a10g-24gb", device_type="cuda", memory_bytes=0, bf16=True, fp16=True,
             fp32_flops=31e12, bf16_flops=125e12, memory_bandwidth_bytes_s=0.6e12,
             interconnect_bytes_s=32e9, host_link_bytes_s=32e9),
    Hardware(name="rtx4090-24gb", device_type="cuda", memory_bytes=0, bf16=True,
             fp16=True, fp32_flops=82e12, bf16_flops=165e12,
             memory_bandwidth_bytes_s=1.0e12, interconnect_bytes_s=32e9,
             host_link_bytes_s=32e9),
    Hardware(name="v100-32gb", device_type="cuda", memory_bytes=0, bf16=False,
             fp16=True, fp32_flops=15.7e12, bf16_flops=125e12,
             memory_bandwidth_bytes_s=0.9e12, interconnect_bytes_s=150e9,
             host_link_bytes_s=16e9),
    Hardware(name="t4-16gb", device_type="cuda", memory_bytes=0, bf16=False, fp16=True,
             fp32_flops=8.1e12, bf16_flops=65e12, memory_bandwidth_bytes_s=0.32e12,
             interconnect_bytes_s=16e9, host_link_bytes_s=16e9),
    # the recording CPU: memory unknown (the budget decides), throughputs nominal; the
    # cost model measures CPU speed from the trace's own step time instead
    Hardware(name="cpu", device_type="cpu", memory_bytes=0, bf16=True, fp16=False,
             fp32_flops=1e11, bf16_flops=1e11, memory_bandwidth_bytes_s=50e9,
             interconnect_bytes_s=5e9, host_link_bytes_s=50e9),
)}

def _with_identity(profile: Hardware) -> Hardware:
    """Memory and compute capability from the one GPU table (``memadvisor.gpus``): the
    device's usable bytes (``total_memory``), not its marketing size."""
    identity = gpus.GPUS.get(profile.name)
    if identity is None:
        return profile
    return replace(profile, memory_bytes=identity.total_memory_bytes,
                   compute_capability=identity.capability)


PROFILES = {name: _with_identity(profile) for name, profile in PROFILES.items()}

ALIASES = {"h100": "h100-80gb", "h200": "h200-141gb", "a100": "a100-80gb", "l4": "l4-24gb",
           "a10g": "a10g-24gb", "4090": "rtx4090-24gb", "v100": "v100-32gb", "t4": "t4-16gb"}


def hardware(name: str | None, trace_device: str = "cpu") -> Hardware:
    """The named profile; without a name, the trace's own device type (cpu or a generic GPU)."""
    if not name:
        return PROFILES["cpu"] if not trace_device.startswith("cuda") else PROFILES["h100-80gb"]
    key = ALIASES.get(name.lower(), name.lower())
    if key not in PROFILES:
        raise UserError(f"unknown GPU {name!r}; known: {', '.join(PROFILES)}")
    return PROFILES[key]


def cublas_workspace_bytes(hw: Hardware, config: str | None = None) -> int:
    """Bytes of one cuBLAS workspace on ``hw`` (``gpus.cublas_workspace_bytes``; ``config``
    a CUBLAS_WORKSPACE_CONFIG value); 0 on the CPU."""
    if hw.device_type != "cuda":
        return 0
    return gpus.cublas_workspace_bytes(hw.compute_capability, config)


# --- device-dependent rules (target device type -> rule) -----------------------------------
#: ops autocast runs in the low-precision dtype (torch/csrc/autograd autocast_mode.cpp lists)
_LOWER_COMMON = frozenset({
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::matmul",
    "aten::linear", "aten::convolution", "aten::_convolution", "aten::conv1d",
    "aten::conv2d", "aten::conv3d", "aten::conv_transpose1d", "aten::conv_transpose2d",
    "aten::conv_transpose3d", "aten::mkldnn_convolution", "aten::cudnn_convolution",
    "aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_cudnn_attention",
    "aten::prelu", "aten::_native_multi_head_attention"})
#: ops autocast runs in fp32 (losses, norms on CUDA, softmax on CUDA, ...)
_FP32_COMMON = frozenset({
    "aten::nll_loss", "aten::nll_loss_forward", "aten::nll_loss2d_forward",
    "aten::cross_entropy_loss", "aten::_log_softmax", "aten::log_softmax", "aten::mse_loss",
    "aten::binary_cross_entropy_with_logits", "aten::smooth_l1_loss", "aten::l1_loss",
    "aten::huber_loss", "aten::kl_div", "aten::cosine_embedding_loss"})
_FP32_CUDA_ONLY = frozenset({
    "aten::native_layer_norm", "aten::layer_norm", "aten::native_group_norm",
    "aten::group_norm", "aten::_softmax", "aten::softmax", "aten::norm", "aten::exp",
    "aten::log", "aten::pow", "aten::sum", "aten::prod", "aten::cumsum", "aten::rsqrt"})

#: CPU-only: oneDNN's recurrent layer (what nn.LSTM/GRU/RNN run per layer and direction on
#: the CPU; AutocastCPU's lower_precision_fp list has it, AutocastCUDA's has cuDNN's instead)
_LOWER_CPU_ONLY = frozenset({"aten::mkldnn_rnn_layer"})

DEVICE_RULES = {
    "cpu": {
        "autocast_lower": _LOWER_COMMON | _LOWER_CPU_ONLY,
        "autocast_fp32": _FP32_COMMON,
        "optimizer_foreach": False,  #: torch.optim picks the per-tensor loop off CUDA
        "dropout_mask_itemsize": 4,  #: bernoulli float mask on CPU
        "fp16_autocast": False,
        #: gloo's all-gather / reduce-scatter copy their buffers (raw blocks seen on CPU);
        #: its worker thread could hold what a collective used until the rank's next one,
        #: but apply drains it after each collective (apply/gloo_release.py): not held
        "collective_copies": {"all_gather": 1, "reduce_scatter": 1, "held_until_next": False},
        #: oneDNN's bf16 matmul allocates a scratch block per call (fp32 gemm: none);
        #: sized by the trace's probes (meta.probes['linear']), else by this formula
        #: fitted to torch 2.13's CPU traces (kernel_blocks.matmul_scratch_bytes)
        "matmul_scratch": {
            "ops": frozenset({"aten::mm", "aten::addmm"}), "dtypes": ("bfloat16",),
            "accumulator_blocks": (128, 64), "packed_bytes_per_inner": 256,
            "overhead": 1664, "weight_gradient_block": 64,
            "weight_gradient_overhead": 1792, "min_inner": 32},
        #: attention's math path (dropout on CPU) computes 16-bit inputs in fp32
        "sdpa_math_upcast": True,
        #: oneDNN's 16-bit convolution blocks as the profiler measured them on this CPU
        #: (meta.probes; kernel_blocks.probed_conv_blocks)
        "conv_probes": True,
    },
    "cuda": {
        "autocast_lower": _LOWER_COMMON,
        "autocast_fp32": _FP32_COMMON | _FP32_CUDA_ONLY,
        "optimizer_foreach": True,  #: foreach on CUDA tensors: step temporaries for all at once
        "dropout_mask_itemsize": 1,  #: native_dropout bool mask
        "fp16_autocast": True,
        "collective_copies": {"all_gather": 0, "reduce_scatter": 0,  #: NCCL works in place
                              "held_until_next": False},
        "matmul_scratch": None,  #: cuBLAS's workspace is not a tensor allocation
        "conv_probes": False,  #: the probes measure oneDNN on the CPU, not cuDNN
        "sdpa_math_upcast": False,  #: flash / memory-efficient kernels take 16-bit as is
    },
}


def device_rules(device_type: str) -> dict:
    return DEVICE_RULES["cuda" if device_type.startswith("cuda") else "cpu"]
