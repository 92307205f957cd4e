"""`memadvisor profile --fake`: unmodified GPU scripts profiled on the CPU-only CI machine.

Each test runs the CLI in a subprocess (the fake CUDA shim loads before torch in its
child) and reads the trace it wrote.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from memadvisor.trace import analysis
from memadvisor.trace.io import read_trace

SCRIPTS = Path(__file__).resolve().parent / "scripts"
CHECKOUT = Path(__file__).resolve().parents[2]
SM80_WORKSPACE_BYTES = 8_519_680  # ":4096:2:16:8" (FACTS.md; the W snapshots' pair)

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="no C++ compiler")


def _profile(tmp_path: Path, script: Path, *options: str, script_args=()):
    trace = tmp_path / f"{script.stem}.trace"
    env = {**os.environ, "PYTHONPATH": str(CHECKOUT)}
    env.pop("CUBLAS_WORKSPACE_CONFIG", None)
    proc = subprocess.run([sys.executable, "-m", "memadvisor.cli", "profile", "--fake",
                           *options, str(script), "-o", str(trace), "--", *script_args],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    return proc, trace


def _line_of(script: Path, marker: str) -> int:
    for number, line in enumerate(script.read_text().splitlines(), 1):
        if marker in line:
            return number
    raise AssertionError(marker)


def test_a_gpu_script_profiles_on_the_simulated_gpu(tmp_path):
    script = SCRIPTS / "gpu_features.py"
    proc, trace_path = _profile(tmp_path, script, "--gpu", "a100-40gb", "--steps", "0")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    trace = read_trace(trace_path)
    events = trace.events
    assert trace.meta.device == "cuda:0"
    assert trace.meta.device_name == "NVIDIA A100-SXM4-40GB"
    assert trace.meta.steps_completed == 3 and trace.meta.status == "completed"
    model_rows = events[events.device == "cuda:0"]
    categories = set(model_rows.category)
    assert {"parameter", "gradient", "optimizer_state", "activation",
            "autocast_weight"} <= categories
    # autocast('cuda', bf16) really cast: bf16 activations saved for backward
    assert (model_rows[model_rows.category == "activation"].dtype == "bfloat16").any()
    # parameter storages as the model has them: 4 x (64x192+192 + 64x64+64 + 64x256+256
    # + 256x64+64) per block x 2 + embedding + head, fp32
    parameter_rows = model_rows[(model_rows.category == "parameter")
                                & (model_rows.action == "alloc")]
    parameters = 2 * (64 * 192 + 192 + 64 * 64 + 64 + 64 * 256 + 256 + 256 * 64 + 64) \
        + 100 * 64 + 64 * 100 + 100
    assert parameter_rows.size_bytes.sum() == 4 * parameters
    # cuBLAS workspaces: one for the forward's thread, one for autograd's, never freed
    workspaces = events[events.op == "cublas_workspace"]
    assert list(workspaces.action) == ["alloc", "alloc"]
    assert list(workspaces.size_bytes) == [SM80_WORKSPACE_BYTES] * 2
    assert list(workspaces.phase) == ["forward", "backward"]
    assert set(workspaces.category) == {"other"}
    fake = trace.meta.extra["fake"]
    assert fake["gpu"] == "a100-40gb" and fake["nproc"] == 1 and fake["rank"] == 0
    # the allocator model's per-step peaks are printed
    assert "step 2: peak allocated" in proc.stderr and "peak reserved" in proc.stderr


def test_a_placeholder_read_is_reported_by_line(tmp_path):
    script = SCRIPTS / "gpu_features.py"
    proc, trace_path = _profile(tmp_path, script, "--gpu", "a100-40gb", "--steps", "0")
    assert proc.returncode == 0, proc.stderr
    line = _line_of(script, "LOSS-ITEM")
    reads = read_trace(trace_path).meta.extra["fake"]["placeholder_reads"]
    # AdamW reading its step count is torch's own read, not the script's
    assert [read["location"] for read in reads] == [f"{script}:{line}"]
    assert reads[0]["reads"] == 3 and reads[0]["value"] == "1.0"
    assert f"warning: {script}:{line} read tensor values 3 time(s)" in proc.stderr
    assert "step 0 loss 1.000" in proc.stdout  # the placeholder the script printed


def _parameter_bytes_at_step_end(trace_path: Path, device: str) -> int:
    trace = read_trace(trace_path)
    events = trace.events
    rows = events[(events.device == device) & (events.category == "parameter")]
    signed = np.where(rows.action == "alloc", rows.size_bytes, -rows.size_bytes)
    end_of_step_0 = rows.step.to_numpy() == 0
    return int(signed[end_of_step_0].sum())


def test_fsdp2_over_two_fake_ranks_halves_each_ranks_parameters(tmp_path):
    script = SCRIPTS / "fsdp_train.py"
    (tmp_path / "one").mkdir()
    one, one_trace = _profile(tmp_path / "one", script, "--gpu", "h100-80gb")
    two, two_trace = _profile(tmp_path, script, "--gpu", "h100-80gb", "--nproc", "2",
                              "--rank", "1")
    assert one.returncode == 0, one.stderr
    assert two.returncode == 0, two.stderr
    assert read_trace(two_trace).meta.device == "cuda:1"
    assert read_trace(two_trace).meta.extra["fake"]["nproc"] == 2
    full = _parameter_bytes_at_step_end(one_trace, "cuda:0")
    sharded = _parameter_bytes_at_step_end(two_trace, "cuda:1")
    assert full == 4 * (256 * 1024 + 1024 + 1024 * 256 + 256)
    assert sharded == full // 2


def test_a_data_dependent_loop_ends_with_one_line_naming_it(tmp_path):
    script = SCRIPTS / "endless_loop.py"
    proc, trace_path = _profile(tmp_path, script, "--gpu", "a100-40gb")
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    line = _line_of(script, "DATA-DEPENDENT")
    message = [text for text in proc.stderr.splitlines()
               if "reads tensor values in a loop" in text]
    assert len(message) == 1 and f"{script}:{line}" in message[0]
    assert "kept partial trace" in proc.stderr
    trace = read_trace(trace_path)
    assert trace.meta.status == "error" and f"{script}:{line}" in trace.meta.error
    assert len(trace.events) > 1000  # the loop's temporaries, recorded until it stopped


def test_bad_input_is_one_line(tmp_path):
    script = SCRIPTS / "gpu_features.py"
    proc, _ = _profile(tmp_path, script, "--gpu", "no-such-gpu")
    assert proc.returncode == 2 and "unknown GPU 'no-such-gpu'" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    proc, _ = _profile(tmp_path, script, "--nproc", "2", "--rank", "2")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("script, args", [
    (CHECKOUT / "examples" / "gpt_lm.py", ("--steps", "2")),
    (SCRIPTS / "conv_train.py", ()),
    (SCRIPTS / "conv_train.py", ("--bf16",)),
    (SCRIPTS / "conv_train.py", ("--checkpoint",)),
], ids=["gpt_lm", "conv", "conv-bf16", "conv-checkpoint"])
def test_fake_cpu_run_has_the_real_runs_peak_kernel_blocks_included(tmp_path, script, args):
    """Without --gpu the script runs on fake CPU tensors; what real kernels allocate for
    themselves (dtype 'bytes': oneDNN scratch, im2col buffers) is measured on this machine
    op by op (profile/cpu_scratch.py).  Each step's peak equals the real run's, whose
    native engine saw those blocks -- both measured here, so on any CPU."""
    fake, fake_trace = _profile(tmp_path, script, "--steps", "2", script_args=args)
    assert fake.returncode == 0, fake.stderr
    real_trace = tmp_path / "real.trace"
    real = subprocess.run([sys.executable, "-m", "memadvisor.cli", "profile", str(script),
                           "-o", str(real_trace), "--steps", "2", "--engine", "native",
                           "--no-probes", "-q", "--", *args],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(CHECKOUT)})
    assert real.returncode == 0, real.stderr
    real_trace, fake_trace = read_trace(real_trace), read_trace(fake_trace)
    assert set(fake_trace.events.device) == {"cpu"}
    measured = fake_trace.meta.extra["fake"]["cpu_kernel_blocks"]
    assert measured["signatures_measured"] > 10 and measured["failed"] == 0
    # every measured op's fake outputs have the real kernel's dtypes and shapes (the CPU's
    # fp32 norm statistics under bf16 autocast: fake/norm_statistics.py)
    assert measured["output_mismatches"] == {}
    real_peaks = [step["peak_bytes"] for step in real_trace.meta.steps]
    fake_peaks = [step["peak_bytes"] for step in fake_trace.meta.steps]
    assert fake_peaks == real_peaks
    # the kernels' own blocks are there, and they matter: without them the peak is lower
    blocks = fake_trace.events[fake_trace.events.dtype == "bytes"]
    assert len(blocks) > 0
    tensors_only = fake_trace.events[fake_trace.events.dtype != "bytes"]
    assert int(analysis.live_bytes(tensors_only[["action", "size_bytes"]]).max()) \
        <= max(fake_peaks)
    if "--checkpoint" in args:
        # the generator's state each checkpointed call keeps (made outside any op)
        states = fake_trace.events[fake_trace.events.op == "torch.get_rng_state"]
        assert len(states) > 0
        assert set(states.size_bytes) == {torch.get_rng_state().untyped_storage().nbytes()}


def test_deep_copies_of_fake_modules_share_the_mode(tmp_path):
    proc, trace_path = _profile(tmp_path, SCRIPTS / "deepcopy_train.py", "--gpu", "a100-40gb")
    assert proc.returncode == 0, proc.stderr
    assert "ok cuda:0 True" in proc.stdout
    trace = read_trace(trace_path)
    assert trace.meta.steps_completed == 2
    # the EMA copy's weight and bias are storages of their own on the GPU
    rows = trace.events[(trace.events.device == "cuda:0") & (trace.events.action == "alloc")]
    assert (rows.size_bytes == 2 * 2 * 4).sum() >= 2


def test_a_script_with_its_own_ddp_runs_on_fake_ranks(tmp_path):
    proc, trace_path = _profile(tmp_path, SCRIPTS / "ddp_train.py", "--gpu", "a100-40gb",
                                "--nproc", "2", "--rank", "1")
    assert proc.returncode == 0, proc.stderr
    trace = read_trace(trace_path)
    assert trace.meta.steps_completed == 2 and "ok" in proc.stdout
    rows = trace.events[(trace.events.device == "cuda:1") & (trace.events.action == "alloc")]
    weight_bytes = 1024 * 1024 * 4
    # the weight, its gradient and DDP's gradient bucket: one block each of the weight's size
    assert (rows.size_bytes == weight_bytes).sum() >= 3


def test_integer_values_are_real_on_the_cpu_target(tmp_path):
    """No GPU: every tensor is a CPU tensor, so size cannot tell data from model; the
    small integer and bool results (lengths, masks) are real, float tensors stay fake."""
    proc, trace_path = _profile(tmp_path, SCRIPTS / "cpu_values.py")
    assert proc.returncode == 0, proc.stderr
    assert "shapes (14, 8) [3, 3, 2, 2, 2, 1, 1] (3, 7, 8) [7, 5, 2] (12,) 14" in proc.stdout
    assert "read tensor values" not in proc.stderr  # no placeholder was needed
    trace = read_trace(trace_path)
    rows = trace.events[trace.events.action == "alloc"]
    assert (rows.size_bytes == 14 * 8 * 4).any()  # the packed data: 14 rows of 8 floats


def test_small_cpu_tensors_have_their_real_values(tmp_path):
    proc, trace_path = _profile(tmp_path, SCRIPTS / "cpu_values.py", "--gpu", "a100-40gb")
    assert proc.returncode == 0, proc.stderr
    # lengths 7, 5, 2: 14 packed rows, batch sizes by time step, the padded batch back
    assert "shapes (14, 8) [3, 3, 2, 2, 2, 1, 1] (3, 7, 8) [7, 5, 2] (12,) 14" in proc.stdout
    assert "read tensor values" not in proc.stderr  # no placeholder was needed
    trace = read_trace(trace_path)
    rows = trace.events[(trace.events.device == "cuda:0") & (trace.events.action == "alloc")]
    # the packed data on the GPU: 14 rows of 8 floats
    assert (rows.size_bytes == 14 * 8 * 4).any()


FSDP_ON_CPU = """
import torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.fsdp import fully_shard
dist.init_process_group("gloo")
model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
for layer in (model[0], model[2]):
    fully_shard(layer)
fully_shard(model)
optimizer = torch.optim.AdamW(model.parameters())
for _ in range(2):
    model(torch.randn(8, 64)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
dist.destroy_process_group()
"""


def test_fsdp_on_the_cpu_has_gloos_collective_blocks(tmp_path):
    """FSDP on the CPU target runs on gloo, whose all-gather takes a block of its output's
    size and whose reduce-scatter copies its input (profile/gloo_buffers.py): each layer's
    unsharded parameters, in bytes, on both."""
    script = tmp_path / "fsdp_cpu.py"
    script.write_text(FSDP_ON_CPU)
    proc, trace = _profile(tmp_path, script, "--nproc", "2", "--rank", "0", "--steps", "2")
    assert proc.returncode == 0, proc.stderr
    events = read_trace(trace).events
    layers = {(64 * 128 + 128) * 4, (128 * 64 + 64) * 4}
    gathered = events[(events.op == "c10d::_allgather_base_") & (events.action == "alloc")]
    scattered = events[(events.op == "c10d::_reduce_scatter_base_") & (events.action == "alloc")]
    assert len(gathered) >= 4 and set(gathered.size_bytes) <= layers
    assert len(scattered) >= 2 and set(scattered.size_bytes) <= layers
    assert read_trace(trace).meta.extra["fake"]["gloo_collective_blocks"] == \
        len(gathered) + len(scattered)
