"""A small real CPU tensor copied to the simulated GPU keeps its values for its way back
(fake/mode.py, 4.): pack_padded_sequence(enforce_sorted=False) sorts on the CPU, moves the
order to the GPU, and pad_packed_sequence indexes the CPU lengths with it again.  Before,
``.cpu()`` of any fake CUDA tensor made a real CPU tensor of uninitialised memory (an
IndexError, or silently wrong shapes, at random)."""
from __future__ import annotations

import shutil

import pytest

from .test_profile_fake import _profile

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="no C++ compiler")

SCRIPT = """\
import torch
from torch._subclasses.fake_tensor import is_fake
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence
order = torch.tensor([2, 0, 1]).cuda()
print("ROUND", order.cpu().tolist(), is_fake(order.cpu()))
print("OTHER", is_fake(torch.empty(3, dtype=torch.long, device="cuda").cpu()))
sample = torch.randn(16, 8, device="cuda")
print(f"MEAN {sample.mean():.4f} {sample.cpu().mean():.2f}")  # zoo/vae.py's log line
lengths = torch.tensor([3, 5, 2, 4])
gru = torch.nn.GRU(8, 16, batch_first=True).cuda()
opt = torch.optim.SGD(gru.parameters(), lr=0.1)
for _ in range(2):
    x = torch.randn(4, 5, 8, device="cuda")
    out, _ = gru(pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False))
    padded, _ = pad_packed_sequence(out, batch_first=True)
    print("PADDED", tuple(padded.shape))
    padded.sum().backward()
    opt.step()
    opt.zero_grad()
"""


def test_values_come_back_and_nothing_is_invented(tmp_path):
    script = tmp_path / "round_trip.py"
    script.write_text(SCRIPT)
    proc, _ = _profile(tmp_path, script, "--gpu", "h100-80gb", "--steps", "0")
    assert proc.returncode == 0, proc.stderr
    assert "ROUND [2, 0, 1] False" in proc.stdout
    assert "OTHER True" in proc.stdout  # a fake CPU tensor, not uninitialised memory
    # a formatted one-value fake tensor prints its placeholder value (was a TypeError)
    assert "MEAN 1.0000 1.00" in proc.stdout
    assert proc.stdout.count("PADDED (4, 5, 16)") == 2
