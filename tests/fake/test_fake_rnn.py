"""nn.RNN / nn.LSTM / nn.GRU on the simulated GPU take cuDNN's path (fake/cudnn_rnn.py).

On this CPU build an RNN on a 'cuda' tensor would run one fused cell per step
(``_thnn_fused_gru_cell``: refused, no meta kernel); a real GPU runs ``_cudnn_rnn`` once
with a reserve buffer saved for backward and a workspace freed inside the op.  The sizes
are the rules measured on an H100 (cuDNN 9.19), checked here against figures read off the
GPU's memory history.
"""
from __future__ import annotations

import shutil

import pytest

from memadvisor.fake import cudnn_rnn
from memadvisor.trace.io import read_trace

from .test_profile_fake import _profile

needs_compiler = pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None, reason="no C++ compiler")

GRU, LSTM, RNN_TANH = 3, 2, 1

# (mode, tokens, steps, batch, hidden, proj, layers, directions, elem, dropout, reserve bytes)
# read off an H100's memory history (torch 2.11, cuDNN 9.19), 2026-11-26
MEASURED_RESERVES = [
    (GRU, 2870, 19, 256, 32, 0, 2, 2, 4, 0.0, 9_551_616),   # zoo bigru_tagger --batch-size 256
    (GRU, 96, 19, 8, 32, 0, 2, 2, 4, 0.0, 319_744),         # zoo bigru_tagger (defaults)
    (GRU, 2637, 19, 256, 32, 0, 3, 2, 4, 0.3, 13_657_344),  # dropout between layers
    (GRU, 2637, 19, 256, 32, 0, 2, 2, 2, 0.0, 4_388_224),   # bf16 / autocast
    (LSTM, 12800, 50, 256, 128, 0, 2, 2, 4, 0.0, 144_179_456),
    (LSTM, 40, 5, 8, 32, 0, 1, 1, 4, 0.0, 25_856),
    (LSTM, 76, 19, 8, 32, 0, 2, 2, 4, 0.3, 216_704),
    (LSTM, 4864, 19, 256, 256, 64, 2, 2, 4, 0.0, 134_480_128),  # proj_size
    (RNN_TANH, 2637, 19, 256, 32, 0, 3, 2, 4, 0.0, 3_375_616),
    (RNN_TANH, 12800, 50, 256, 512, 0, 2, 2, 4, 0.0, 157_286_656),
]


@pytest.mark.parametrize("case", MEASURED_RESERVES)
def test_the_reserve_rule_gives_the_measured_bytes(case):
    *args, measured = case
    mode, tokens, steps, batch, hidden, proj, layers, dirs, elem, dropout = args
    assert cudnn_rnn.reserve_bytes(mode, tokens, steps, batch, hidden, proj, layers, dirs,
                                   elem, dropout, True) == measured
    assert cudnn_rnn.reserve_bytes(mode, tokens, steps, batch, hidden, proj, layers, dirs,
                                   elem, dropout, False) == 0  # inference keeps none


@pytest.mark.parametrize("tokens, measured", [(2870, 38_006_528), (96, 33_820_928)])
def test_the_workspace_rule_is_near_the_measured_bytes(tokens, measured):
    # the two zoo bigru_tagger runs (E=H=32, 2 layers, bidirectional, packed, fp32)
    predicted = cudnn_rnn.workspace_bytes(GRU, tokens, 32, 32, 2, 2, True, 31_488, 4)
    assert abs(predicted - measured) / measured < 0.03


def test_the_dropout_state_is_48_kib_per_sm():
    assert cudnn_rnn.dropout_state_bytes(132) == 6_488_064  # measured on an H100


SCRIPT = """\
import torch
import torch.nn as nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

torch.manual_seed(0)
gru = nn.GRU(32, 32, num_layers=2, bidirectional=True, batch_first=True).cuda()
lstm = nn.LSTM(64, 48, num_layers=2, dropout=0.25).cuda()
rnn = nn.RNN(48, 16).cuda()
params = [*gru.parameters(), *lstm.parameters(), *rnn.parameters()]
opt = torch.optim.SGD(params, lr=0.1)
lengths = torch.tensor([19, 17, 12, 12, 9, 5, 3, 2])  # sorted: 79 tokens
for step in range(2):
    x = torch.randn(8, 19, 32, device="cuda")
    packed = pack_padded_sequence(x, lengths, batch_first=True)
    out, h = gru(packed)
    padded, _ = pad_packed_sequence(out, batch_first=True)   # (8, 19, 64)
    seq, (hn, cn) = lstm(padded.transpose(0, 1))              # dense, sequence first
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y, _ = rnn(seq)                                       # bf16 under autocast
    (y.float().sum() + hn.sum()).backward()
    opt.step()
    opt.zero_grad()
"""


@needs_compiler
def test_rnns_run_cudnn_on_the_simulated_gpu(tmp_path):
    script = tmp_path / "rnns.py"
    script.write_text(SCRIPT)
    proc, trace_path = _profile(tmp_path, script, "--gpu", "h100-80gb", "--steps", "0")
    assert proc.returncode == 0, proc.stderr
    events = read_trace(trace_path).events
    ops = set(events["op"])
    assert {"aten::_cudnn_rnn", "aten::_cudnn_rnn_backward", "aten::_cudnn_rnn_flatten_weight",
            "memadvisor::cudnn_rnn_workspace"} <= ops, ops
    assert not any("fused_gru_cell" in op or "fused_lstm_cell" in op for op in ops), ops
    allocs = events[(events["action"] == "alloc") & (events["step"] == 1)]

    def sizes(op, phase):
        rows = allocs[(allocs["op"] == op) & (allocs["phase"] == phase)]
        return sorted(rows["size_bytes"])

    gru_params = 2 * ((96 * 32 + 96 * 32 + 2 * 96) + (96 * 64 + 96 * 32 + 2 * 96))
    lstm_params = (192 * 64 + 192 * 48 + 2 * 192 + 192 * 48 + 192 * 48 + 2 * 192)
    # forward: output, hy, (cy,) reserve; the reserve follows the measured rule
    gru_reserve = cudnn_rnn.reserve_bytes(GRU, 79, 19, 8, 32, 0, 2, 2, 4, 0.0, True)
    assert gru_reserve in sizes("aten::_cudnn_rnn", "forward")
    assert 79 * 64 * 4 in sizes("aten::_cudnn_rnn", "forward")  # packed output
    lstm_reserve = cudnn_rnn.reserve_bytes(LSTM, 19 * 8, 19, 8, 48, 0, 2, 1, 4, 0.25, True)
    assert lstm_reserve in sizes("aten::_cudnn_rnn", "forward")
    rnn_reserve = cudnn_rnn.reserve_bytes(RNN_TANH, 19 * 8, 19, 8, 16, 0, 1, 1, 2, 0.0, True)
    assert rnn_reserve in sizes("aten::_cudnn_rnn", "forward")  # bf16: autocast
    # the workspace, freed inside each call
    gru_ws = cudnn_rnn.workspace_bytes(GRU, 79, 32, 32, 2, 2, True, gru_params, 4)
    assert gru_ws in sizes("memadvisor::cudnn_rnn_workspace", "forward")
    # backward: the same, plus the zeros for the gradients that did not come (GRU: h_n)
    assert gru_ws + 4 * 8 * 32 * 4 in sizes("memadvisor::cudnn_rnn_workspace", "backward")
    # backward: one flat weight gradient (the parameters' views), dx
    assert gru_params * 4 in sizes("aten::_cudnn_rnn_backward", "backward")
    assert lstm_params * 4 in sizes("aten::_cudnn_rnn_backward", "backward")
    # flatten_parameters: one buffer of every weight
    flattened = events[(events["op"] == "aten::_cudnn_rnn_flatten_weight")
                       & (events["action"] == "alloc")]
    assert {gru_params * 4, lstm_params * 4} <= set(flattened["size_bytes"])
    # dropout between the LSTM's layers: one state per device, made once
    states = events[(events["op"] == "aten::_cudnn_init_dropout_state")
                    & (events["action"] == "alloc")]
    assert list(states["size_bytes"]) == [cudnn_rnn.dropout_state_bytes(132)]
