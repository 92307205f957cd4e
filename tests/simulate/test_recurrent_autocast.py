"""CPU autocast runs oneDNN's recurrent layer in 16 bits (``mkldnn_rnn_layer`` is on
AutocastCPU's lower-precision list): an nn.LSTM's outputs, and what they feed, are bf16
under amp-bf16.  Predicted from the fp32 trace against the same loop run with the plan set
up by ``apply``'s helpers (the LSTM seq2seq of the new-user trial predicted its LSTM's
outputs fp32: +25.9%)."""
import numpy as np
import pytest
import torch
import torch.nn as nn

from memadvisor.simulate.hardware import device_rules
from memadvisor.trace.io import Trace

from loops import run_with_apply_precision

BATCH, SEQ, WIDTH = 4, 12, 32


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, WIDTH)
        self.rnn = nn.LSTM(WIDTH, WIDTH, num_layers=2, batch_first=True)
        self.head = nn.Linear(WIDTH, 10)

    def forward(self, tokens):
        out, _ = self.rnn(self.embed(tokens))
        return self.head(torch.tanh(out).mean(1))


def run(precision: str = "fp32") -> Trace:
    torch.manual_seed(0)

    def batch(gen):
        return (torch.randint(50, (BATCH, SEQ), generator=gen),
                torch.randint(10, (BATCH,), generator=gen))

    return run_with_apply_precision(Tagger(), batch, precision)


def _floating_dtypes(timeline, count: int, op: str) -> list[str]:
    from memadvisor.simulate.replay import PHASE_CODE

    rows = np.arange(count)
    ops = np.asarray(timeline.ops, dtype=object)
    dtypes = np.asarray(timeline.dtypes, dtype=object)
    keep = (timeline.phase[rows] == PHASE_CODE["forward"]) & (timeline.alloc_key[rows] >= 0) \
        & (ops[timeline.op[rows]] == op) \
        & timeline.dtype_in(("float32", "bfloat16", "float16"))[rows]
    return sorted(dtypes[timeline.dtype[rows[keep]]])


def test_the_cpu_rules_list_the_recurrent_layer_and_torch_autocasts_it():
    assert "aten::mkldnn_rnn_layer" in device_rules("cpu")["autocast_lower"]
    # the installed torch registers an AutocastCPU kernel for it (the rule follows torch)
    dump = torch._C._dispatch_dump("aten::mkldnn_rnn_layer")
    assert "AutocastCPU:" in dump


@pytest.mark.parametrize("op", ["aten::mkldnn_rnn_layer", "aten::tanh"])
def test_the_lstm_and_what_it_feeds_are_16bit_as_in_the_run(op):
    from memadvisor.simulate.precision import apply_precision
    from memadvisor.simulate.replay import build_timeline

    fp32 = run()
    try:
        amp = run("amp-bf16")
    except RuntimeError as exc:
        # oneDNN without bf16 kernels on this CPU (e.g. ONEDNN_MAX_CPU_ISA=AVX2) cannot make
        # a bf16 LSTM at all: there is no run here to compare with
        if "primitive descriptor" not in str(exc):
            raise
        pytest.skip(f"this CPU's oneDNN cannot run a bf16 LSTM: {str(exc).splitlines()[0]}")
    base = build_timeline(fp32)
    predicted = apply_precision(base, "amp-bf16", "cpu")
    measured = build_timeline(amp)
    if not _floating_dtypes(base, len(base), "aten::mkldnn_rnn_layer"):
        pytest.skip("this torch build runs nn.LSTM without oneDNN's recurrent layer")
    want = _floating_dtypes(measured, len(measured), op)
    got = _floating_dtypes(predicted, len(base), op)
    assert want and set(want) == {"bfloat16"}, want  # what torch did, on this machine
    assert got == want
