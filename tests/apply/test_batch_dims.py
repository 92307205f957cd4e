"""micro_batches cuts each tensor along its own batch dimension, found from the tensors at
run time: sequence-first tensors along dimension 1, shared masks never; what the shapes
cannot tell is refused, not guessed."""
import pytest
import torch
from torch import nn

from memadvisor.apply import batching
from memadvisor.plan import Plan, PlanError


def parts(values, plan="accum=2", rank=0, **kwargs):
    return list(batching.split(values, Plan.parse(plan), rank, **kwargs))


def test_sequence_first_tensors_are_cut_along_the_batch_and_square_masks_stay_whole():
    src, tgt = torch.arange(13 * 8).view(13, 8), torch.arange(12 * 8).view(12, 8)
    src_mask, tgt_mask = torch.zeros(13, 13), torch.zeros(12, 12)
    padding = torch.zeros(8, 13, dtype=torch.bool)
    with pytest.warns(UserWarning, match="no dimension of the batch size 8"):
        first, second = parts((src, tgt, src_mask, tgt_mask, padding))
    assert first[0].shape == (13, 4) and first[1].shape == (12, 4)
    assert first[2] is src_mask and first[3] is tgt_mask
    assert first[4].shape == (4, 13)
    assert torch.equal(torch.cat([first[0], second[0]], dim=1), src)


def test_ambiguous_layouts_follow_the_model_or_are_refused():
    src, tgt = torch.zeros(10, 4), torch.zeros(10, 4)  # [T, B] or [B, T]?
    with pytest.warns(UserWarning, match=r"dimension 0 is taken, as in a batch-first layout"):
        first, _ = parts((src, tgt))
    assert first[0].shape == (5, 4)
    with pytest.raises(PlanError, match=r"batch_dims=\(0, 0\)"):
        parts((torch.zeros(10, 4), torch.zeros(4, 10)))  # no batch-first reading either
    seq_first = nn.Transformer(d_model=8, nhead=2, num_encoder_layers=1,
                               num_decoder_layers=1, dim_feedforward=8)
    first, _ = parts((src, tgt), model=seq_first)
    assert first[0].shape == (10, 2)
    batch_first = nn.LSTM(4, 4, batch_first=True)
    first, _ = parts((src, tgt), model=batch_first)
    assert first[0].shape == (5, 4)
    explicit, _ = parts((src, tgt), batch_dims=(1, 1))
    assert explicit[1].shape == (10, 2)


def test_a_decision_is_kept_for_a_later_batch_whose_length_equals_the_batch_size():
    decided: dict = {}
    parts((torch.zeros(6, 4), torch.zeros(6, 4), torch.zeros(4)), decided=decided)
    first, _ = parts((torch.zeros(4, 4), torch.zeros(4, 4), torch.zeros(4)), decided=decided)
    # the first batch was [T=6, B=4] (labels [4] settled it): dimension 1 is kept for the
    # [4, 4] batch, where dimension 0 would fit as well
    assert first[0].shape == (4, 2)
    ambiguous = (torch.zeros(6, 6), torch.zeros(6, 6))
    with pytest.warns(UserWarning, match="dimension 0 is taken"):
        first, _ = parts(ambiguous)
    assert first[0].shape == (3, 6)
    first, _ = parts(ambiguous, decided={(2, 2): (1, 1)})
    assert first[0].shape == (6, 3)


def test_a_flattened_sequence_first_target_is_refused():
    data, targets = torch.zeros(16, 8), torch.zeros(128)  # targets = next tokens .view(-1)
    lstm = nn.LSTM(4, 4)  # sequence-first: the batch is 8
    with pytest.raises(PlanError, match=r"shape \[128\] .* is the batch flattened"):
        parts((data, targets), model=lstm)


def test_packed_sequences_are_refused():
    packed = nn.utils.rnn.pack_padded_sequence(torch.zeros(5, 2, 3), [5, 3])
    with pytest.raises(PlanError, match="PackedSequence cannot be split"):
        parts((packed,))
