"""offload=activations keeps each saved tensor's layout (precision.offload_saved_tensors).

torch.autograd.graph.save_on_cpu packs a saved tensor into a compact copy: backward gets
different strides than forward saved.  On a real H100 that broke nn.Transformer with key
padding masks (the memory-efficient attention's backward: ``attn_bias is not correctly
aligned (strideM)``).  These checks run the pack/unpack copies on the CPU (device_type='cpu'
makes every CPU tensor one to offload); the CUDA ones are skipped without a GPU.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from memadvisor.apply.precision import offload_saved_tensors

SEEN: list = []


class SavesAsIs(torch.autograd.Function):
    """Saves a given tensor for backward and records what backward gets back."""

    @staticmethod
    def forward(ctx, x, saved):
        ctx.save_for_backward(saved)
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        (saved,) = ctx.saved_tensors
        SEEN.append((tuple(saved.size()), saved.stride(), saved.clone(), saved))
        return grad * 2, None


def _round_trip(hooks, saved: torch.Tensor):
    SEEN.clear()
    x = torch.randn(3, requires_grad=True, device=saved.device)
    with hooks:
        y = SavesAsIs.apply(x, saved)
    y.sum().backward()
    [seen] = SEEN
    return seen


def _padded_bias(device="cpu"):
    """Like the attention bias the memory-efficient kernel saves: last dim padded to 16."""
    return torch.randn(2, 4, 13, 16, device=device)[..., :13]


LAYOUTS = {
    "padded": _padded_bias,
    "expanded": lambda: torch.randn(1, 13).expand(6, 13),
    "transposed": lambda: torch.randn(5, 7).t(),
    "channels_last": lambda: torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
    "storage_offset": lambda: torch.randn(10, 8)[3:6],
    "overlapping": lambda: torch.randn(20).unfold(0, 4, 2),
    "scalar": lambda: torch.tensor(3.0),
    "empty": lambda: torch.randn(0, 4),
    "bool_padded": lambda: (torch.randn(3, 8) > 0)[:, :5],
}


def test_save_on_cpu_loses_the_layout():
    """The bug: torch's save_on_cpu (pinned path, as the plan used it) hands backward a
    compact copy of a padded view."""
    saved = _padded_bias()
    size, stride, value, _ = _round_trip(
        torch.autograd.graph.save_on_cpu(pin_memory=True, device_type="cuda"), saved)
    assert torch.equal(value, saved)
    assert stride != saved.stride()  # (507, 169, 13, 1) instead of (832, 208, 16, 1)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_backward_gets_the_saved_layout(name):
    saved = LAYOUTS[name]()
    size, stride, value, unpacked = _round_trip(offload_saved_tensors("cpu"), saved)
    assert size == tuple(saved.size())
    assert stride == saved.stride()
    assert torch.equal(value, saved)
    if saved.numel():
        assert unpacked.data_ptr() != saved.data_ptr()  # a copy, not the tensor itself


def test_a_view_spanning_far_more_than_its_elements_is_copied_densely():
    wide = torch.randn(64, 64)
    column = wide[:, 2:4]  # spans 32x its elements: dense, dimensions in the same order
    size, stride, value, _ = _round_trip(offload_saved_tensors("cpu"), column)
    assert torch.equal(value, column) and stride == (2, 1)
    transposed = wide.t()[:3]  # rows of the transpose: column-major kept
    size, stride, value, _ = _round_trip(offload_saved_tensors("cpu"), transposed)
    assert torch.equal(value, transposed) and stride == (1, 3)


def test_host_copies_hold_the_span_not_the_expanded_elements():
    hooks = offload_saved_tensors("cpu")
    expanded = torch.randn(1, 1000).expand(500, 1000)
    packed = hooks.pack(expanded)
    assert packed[0] == "span" and packed[2].numel() == 1000
    padded = _padded_bias()
    packed = hooks.pack(padded)
    # the span from the first element to the last: padding between rows, not after the last
    assert packed[0] == "span" and packed[2].numel() == (2 * 4 * 13 - 1) * 16 + 13
    assert hooks.unpack(packed).stride() == padded.stride()


def test_tensors_on_another_device_are_kept_as_they_are():
    hooks = offload_saved_tensors("cuda")
    t = torch.randn(4, 4)
    assert hooks.pack(t)[0] == "kept" and hooks.unpack(hooks.pack(t)) is t
    assert hooks.pinned is torch.cuda.is_available()
    assert offload_saved_tensors("cpu").pinned is False


def test_gradients_match_a_run_without_offload():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                          nn.Flatten(), nn.Linear(8 * 6 * 6, 5))
    model = model.to(memory_format=torch.channels_last)
    x = torch.randn(4, 3, 6, 6).to(memory_format=torch.channels_last)
    grads = []
    for hooks in (None, offload_saved_tensors("cpu")):
        model.zero_grad()
        if hooks is None:
            loss = model(x).square().sum()
        else:
            with hooks:
                loss = model(x).square().sum()
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for plain, offloaded in zip(*grads):
        torch.testing.assert_close(offloaded, plain)


def _transformer_step(hooks, device):
    """One nn.Transformer step with key padding masks (zoo/seq2seq_transformer.py's call),
    sequence lengths that are no multiple of 4: the memory-efficient attention pads its bias."""
    torch.manual_seed(0)
    model = nn.Transformer(d_model=64, nhead=4, num_encoder_layers=1, num_decoder_layers=1,
                           dim_feedforward=128, dropout=0.0).to(device)
    src, tgt = torch.randn(13, 8, 64, device=device), torch.randn(11, 8, 64, device=device)
    src_pad = torch.zeros(8, 13, dtype=torch.bool, device=device)
    src_pad[:, 10:] = True
    tgt_pad = torch.zeros(8, 11, dtype=torch.bool, device=device)
    tgt_pad[:, 9:] = True
    tgt_mask = nn.Transformer.generate_square_subsequent_mask(11, device=device)
    src_mask = torch.zeros(13, 13, device=device).bool()
    with hooks:
        out = model(src, tgt, src_mask, tgt_mask, None, src_pad, tgt_pad, src_pad)
    out.square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_transformer_with_padding_masks_trains_under_offload():
    plain = _transformer_step(torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
                              "cpu")
    offloaded = _transformer_step(offload_saved_tensors("cpu"), "cpu")
    for a, b in zip(plain, offloaded):
        torch.testing.assert_close(b, a)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
def test_cuda_padded_bias_keeps_its_layout_through_pinned_memory():
    saved = _padded_bias("cuda")
    size, stride, value, unpacked = _round_trip(offload_saved_tensors("cuda"), saved)
    assert stride == saved.stride() and unpacked.device == saved.device
    assert torch.equal(value, saved)


@cuda
def test_cuda_transformer_with_padding_masks_trains_under_offload():
    """The H100 crash (seq2seq_large__offact): save_on_cpu breaks the memory-efficient
    attention's backward, offload_saved_tensors does not, and its gradients are the ones
    a run without offload computes."""
    plain = _transformer_step(torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
                              "cuda")
    offloaded = _transformer_step(offload_saved_tensors("cuda"), "cuda")
    for a, b in zip(plain, offloaded):
        torch.testing.assert_close(b, a)
    try:
        _transformer_step(torch.autograd.graph.save_on_cpu(pin_memory=True), "cuda")
    except RuntimeError as exc:  # torch's own: the crash this replaces (where the kernel runs)
        assert "aligned" in str(exc)
