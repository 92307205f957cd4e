"""Fake execution end to end, each in a fresh process (the shim loads before torch).

``child.py`` runs the checks and prints JSON; these tests assert on it.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = Path(__file__).resolve().parent / "child.py"
SCRIPT = Path(__file__).resolve().parent / "scripts" / "tiny_train.py"

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="no C++ compiler")


def _child(case: str) -> dict:
    proc = subprocess.run([sys.executable, str(CHILD), case], capture_output=True, text=True,
                          timeout=120, cwd=CHILD.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def train() -> dict:
    return _child("train")


def _line_of(text: str) -> str:
    """The line number of ``text`` in tiny_train.py."""
    for number, line in enumerate(SCRIPT.read_text().splitlines(), 1):
        if text in line:
            return str(number)
    raise AssertionError(text)


def test_the_shim_is_torchs_cuda_runtime(train):
    assert train["torch_imported_by_preload"] is False
    assert train["hooks_active"] and train["guard_active"]
    assert train["cuda_available_after"] is False  # the stubs are gone afterwards


def test_a_gpu_script_runs_as_on_the_target(train):
    seen = train["observed"]
    assert seen["device"] == "cuda" and seen["param_device"] == "cuda:0"
    assert seen["device_name"] == "NVIDIA A100-SXM4-40GB" and seen["bf16"] is True
    assert train["a100_props"] == ["NVIDIA A100-SXM4-40GB", 40_536 * 1024**2, 8, 0]
    assert seen["grad_device"] == "cuda:0"
    assert seen["tied_after_cuda"] is True  # .cuda() kept the tied parameter tied


def test_autocast_cuda_really_casts(train):
    # autocast('cuda') silently disables itself when CUDA looks unavailable: fp32 then
    assert train["observed"]["attention_dtype"] == "torch.bfloat16"
    assert train["observed"]["logits_dtype"] == "torch.bfloat16"


def test_memory_figures_follow_fake_storages(train):
    param_bytes = train["param_bytes"]
    peaks = train["step_peak_bytes"]
    assert len(peaks) == 2  # one per optimizer step
    # parameters, gradients and AdamW's two states are all alive at the step's peak
    assert 4 * param_bytes < peaks[0] < 8 * param_bytes
    # the script's own max_memory_allocated() (reset each step) saw the same peaks
    assert train["observed"]["max_memory_allocated"] == train["a100_step_peak_bytes"]
    # a view keeps its storage alive; CPU tensors are not GPU memory
    assert train["lifetimes"] == [0, 4096, 4096, 0, 0]


def test_value_reads_get_documented_placeholders_and_are_recorded(train):
    values = train["values"]
    assert values["item_float"] == 1.0 and values["item_int"] == 1
    assert values["bool"] is True and values["allclose"] is True
    assert values["tolist"] == [1.0] * 4
    assert values["nonzero_shape"] == [12, 2]  # every element of a 3x4 tensor
    assert values["branch_taken"] is True
    assert len(values["placeholder_lines"]) >= 7
    script_lines = {loc for op, loc, value in train["placeholders"]}
    assert f"{SCRIPT}:{_line_of('losses.append(loss.item())')}" in script_lines
    assert f"{SCRIPT}:{_line_of('print(f')}" in script_lines


def test_a_module_built_before_fake_execution_moves_to_the_fake_gpu(train):
    moved = train["real_module"]
    assert moved["devices"] == ["cuda:0"] and moved["tied"] is True
    assert moved["grad_device"] == "cuda:0"


def test_data_loaders_keep_working(train):
    seen = train["data_loading"]
    assert [row[0] for row in seen] == [0, 0, 2, 2]
    assert all(row[1] == "cpu" and row[2] == "cuda:0" and row[3] == [4, 2] for row in seen)
    assert train["worker_batch_value"] == 4.0  # the real dataset's value, not a placeholder


def test_an_op_without_a_fake_kernel_is_refused_by_name(train):
    op, message = train["refusal"]
    assert op == "memadvisor_test::mystery_kernel"
    assert "register_fake" in message and "child.py:" in message


def test_fsdp2_over_two_fake_ranks():
    out = _child("fsdp")
    assert out["backend"] == "fake" and out["world_size"] == 2 and out["rank"] == 1
    assert out["is_dtensor"] is True
    assert out["global_shape"] == [256, 64] and out["local_shape"] == [128, 64]
    assert out["current_device"] == 1  # LOCAL_RANK of rank 1
    # on the autograd engine's own thread too (DTensor asks "cuda" there in backward)
    assert out["seen_in_backward"] == [[1, "cuda:1"]]
    assert len(out["step_peak_bytes"]) == 1 and out["step_peak_bytes"][0] > 0
    assert out["initialized_after"] is False


def test_fake_execution_after_torch_was_imported_is_refused_in_one_line():
    refused = _child("late")["refused"]
    assert refused and "\n" not in refused and "preload" in refused


def test_attention_runs_the_kernel_the_target_would(train):
    """Flash on an H100 in bf16 keeps the output and a (B, H, L) fp32 logsumexp; the math
    path (a V100 has no bf16 flash/efficient kernel) keeps the (L x L) attention matrix."""
    kept = train["attention_kept_bytes"]
    heads, length, head_dim = 4, 2048, 64
    output_bf16 = heads * length * head_dim * 2
    logsumexp = heads * length * 4
    rng_state = 64  # the kernels' philox seed and offset: a few scalars
    flash = kept["h100-80gb/bf16"] - output_bf16 - logsumexp
    assert 0 <= flash < rng_state
    # memory-efficient: fp32 on any GPU, or flash switched off by the script
    assert 0 <= kept["h100-80gb/fp32"] - 2 * output_bf16 - logsumexp < rng_state
    assert 0 <= kept["h100-80gb/bf16_flash_off"] - output_bf16 - logsumexp < rng_state
    # a boolean mask: efficient with the mask as an additive bf16 bias, saved for backward
    bias = length * length * 2
    assert 0 <= kept["h100-80gb/bf16_mask"] - output_bf16 - logsumexp - bias < rng_state
    # V100 in bf16: math path; it keeps at least the bf16 attention probabilities
    assert kept["v100-32gb/bf16"] >= heads * length * length * 2


def test_deep_copies_keep_real_tensors_real_and_fake_ones_fake(train):
    assert train["deepcopy"] == {"real_stays_real": True, "values": [0.0, 1.0, 2.0],
                                 "fake_stays_fake": True, "fake_device": "cuda:0"}
