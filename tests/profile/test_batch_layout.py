"""The batch dimension from shapes alone (batch_layout.py, shared by profile and apply)."""
from memadvisor.profile.batch_layout import infer_layout, layout_batch_size


def test_sequence_first_inputs_of_different_lengths_share_the_batch():
    # nn.Transformer seq2seq: src [S, B], tgt [T, B], square masks, padding masks [B, S]
    shapes = [(13, 8), (12, 8), (13, 13), (12, 12), (8, 13), (8, 12), (8, 13)]
    layout = infer_layout(shapes)
    assert layout.batch_size == 8 and not layout.ambiguous
    assert layout.dims == (1, 1, None, None, 0, 0, 0)


def test_batch_first_keywords_and_labels():
    layout = infer_layout([(8, 30), (8, 30), (8,)])
    assert (layout.batch_size, layout.dims) == (8, (0, 0, 0))


def test_a_lone_two_dimensional_batch_is_ambiguous_until_evidence_says():
    assert infer_layout([(16, 8)]).ambiguous
    hinted = infer_layout([(16, 8)], layout_sizes=[8])
    assert (hinted.batch_size, hinted.dims, hinted.ambiguous) == (8, (1,), False)
    # the sequence length changed between two batches, the batch size did not
    varying = infer_layout([(16, 8)], varying_sizes=[16, 11])
    assert (varying.batch_size, varying.dims) == (8, (1,))


def test_square_tensor_takes_the_dimension_the_others_use():
    layout = infer_layout([(8, 8), (8,)])
    assert layout.dims == (0, 0) and not layout.ambiguous
    alone = infer_layout([(8, 8)])
    assert alone.ambiguous
    assert infer_layout([(8, 8)], preferred_dims=[1]).dims == (1,)


def test_layout_modules():
    assert layout_batch_size("sequence", False, (16, 8, 32)) == 8
    assert layout_batch_size("sequence", True, (16, 8, 32)) == 16
    assert layout_batch_size("sequence", True, (8, 32)) is None  # unbatched
    assert layout_batch_size("cell", True, (8, 1)) == 8


def test_traces_written_before_batch_dims_read_as_dimension_0():
    from memadvisor.trace.schema import batch_dims_of
    old = {"batch_size": 8, "shapes": [[8, 3], [3, 3], []], "dtypes": ["float32"] * 3}
    assert batch_dims_of(old) == [0, None, None]
    new = dict(old, batch_dims=[1, None, None])
    assert batch_dims_of(new) == [1, None, None]
