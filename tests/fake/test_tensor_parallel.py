"""One rank of a 2-D plan (tp=2, shard=zero3, world=4) on fake tensors: the per-rank
model states, counted from the live fake bytes, against the analytic split."""
from __future__ import annotations

import pytest

from .test_execution import _child, pytestmark  # noqa: F401  (same compiler skip)

# tests/fake/child.py's TINY_LLAMA
VOCAB, DIM, LAYERS, HEADS, KV_HEADS, FFN, SEQ = 256, 64, 2, 4, 2, 128, 16
TP, WORLD = 2, 4


@pytest.fixture(scope="module")
def tp_zero3() -> dict:
    return _child("tp_zero3")


def _expected_states_bytes() -> int:
    """16 B/parameter: q, k, v, o, the MLP's three Linears, the embedding and the head
    (split along the vocabulary) split over tp then sharded over dp (world ranks in all);
    the norms replicated over tp, sharded over dp (world / tp ranks)."""
    head_dim = DIM // HEADS
    split = LAYERS * (2 * DIM * DIM + 2 * DIM * KV_HEADS * head_dim + 3 * DIM * FFN) \
        + 2 * VOCAB * DIM
    replicated = (2 * LAYERS + 1) * DIM
    return 16 * split // WORLD + 16 * replicated // (WORLD // TP)


def test_the_cross_check_counts_the_split_and_the_replicated_parameters(tp_zero3):
    assert tp_zero3["plan"] == "shard=zero3,world=4,tp=2" and tp_zero3["rank"] == 1
    assert tp_zero3["split_bytes"] + tp_zero3["replicated_bytes"] == _expected_states_bytes()


def test_after_each_step_the_rank_holds_its_share_of_parameters_and_adam_states(tp_zero3):
    # gradients are set to None after the step; the 17 int64 tokens are all else alive
    tokens_bytes = (SEQ + 1) * 8
    assert tp_zero3["live_bytes_after"] == _expected_states_bytes() * 12 // 16 + tokens_bytes


def test_the_step_peak_holds_the_sharded_states_and_less_than_one_gpus_whole_model(tp_zero3):
    states = _expected_states_bytes()
    whole = 16 * tp_zero3["parameter_count"]
    assert len(tp_zero3["step_peak_bytes"]) == 2
    for peak in tp_zero3["step_peak_bytes"]:
        assert states <= peak < whole
    # the second step differs from the first by at most the AdamW states (made in the
    # first step's optimizer.step, alive through the second's forward and backward):
    # nothing else is left over from one step to the next
    first, second = tp_zero3["step_peak_bytes"]
    assert 0 <= second - first <= states * 8 // 16


def test_parameters_move_like_on_a_gpu_build(tp_zero3):
    assert tp_zero3["small_parameter_ones_real"] is True
    assert tp_zero3["small_parameter_moved"] == ["cuda:0", True, 32]
    assert tp_zero3["data_property_restored"] is True
