"""The compile advice: what ``torch.compile`` would save, against a real inductor run.

A tiny script (a convolution, BatchNorm, a graph break, LayerNorm, GELU, a Linear head) is
profiled for real on the CPU; the advice predicts on fake tensors what the compiled model
saves for backward; the same script then runs with its model compiled by inductor (C++ on this CPU)
and the tensors its autograd graph holds are summed.  The two must agree within 2%, and
the eager figure must be what plain autograd holds (summed here without memadvisor).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from memadvisor.advice.compile_saving import compile_inserted, compile_saving, \
    measure_compiled_run, saved_tensor_bytes
from memadvisor.errors import UserError

CHECKOUT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent('''
    import torch
    import torch.nn as nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.norm = nn.BatchNorm2d(8)
            self.ln = nn.LayerNorm(8 * 8 * 8)
            self.head = nn.Linear(8 * 8 * 8, 10)

        def forward(self, x):
            x = torch.relu(self.norm(self.conv(x)))
            torch._dynamo.graph_break()  # two graphs, each partitioned on its own
            return self.head(nn.functional.gelu(self.ln(x.flatten(1))))

    def main():
        torch.manual_seed(0)
        model = Net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        for step in range(4):
            x = torch.randn(16, 3, 8, 8)
            y = torch.randint(10, (16,))
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            print(f"step {step} loss {loss.item():.3f}")

    if __name__ == "__main__":
        main()
''')

has_compiler = any(shutil.which(name) for name in
                   (os.environ.get("CXX") or "g++", "g++", "c++", "clang++"))


@pytest.fixture(scope="module")
def profiled(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("compile")
    (folder / "train.py").write_text(SCRIPT)
    trace = folder / "train.trace"
    env = {**os.environ, "PYTHONPATH": str(CHECKOUT), "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "memadvisor.cli", "profile", "train.py", "-o",
                    str(trace), "--steps", "2", "-q"], cwd=folder, env=env, check=True,
                   capture_output=True, timeout=300)
    return trace


@pytest.mark.skipif(not has_compiler, reason="inductor needs a C++ compiler on the CPU, "
                    "and this machine has none (no g++, c++ or clang++)")
def test_prediction_matches_a_real_inductor_run(profiled):
    advice = compile_saving(profiled, method="fake")
    measured = measure_compiled_run(profiled, backend="inductor", steps=2)
    compiled_bytes = measured["saved_bytes"][-1]
    assert compiled_bytes > 0
    assert abs(advice.compiled_saved_bytes - compiled_bytes) <= 0.02 * compiled_bytes
    # the convolution's input and weight are saved as channels-last copies by inductor on
    # a CPU: 16x3x8x8 + 8x3x3x3 float32, part of what the prediction adds to the graph's
    assert sum(g.layout_copy_bytes for g in advice.graphs) == (16 * 3 * 8 * 8 + 8 * 3 * 3 * 3) * 4
    assert len(advice.graphs) == 2 and sum(advice.graph_breaks.values()) == 1
    # eager, on fake tensors: what plain autograd's pack hooks see a real forward save
    assert advice.eager_saved_bytes == _eager_saved_by_pack_hooks()
    assert 0 < advice.predicted_peak_bytes <= advice.eager_peak_bytes + compiled_bytes


def _eager_saved_by_pack_hooks() -> int:
    """Bytes of the distinct storages one eager forward (and the loss) saves, seen by
    ``saved_tensors_hooks`` (no memadvisor code), parameters, buffers and the batch out."""
    namespace: dict = {}
    exec(compile(SCRIPT, "train.py", "exec"), namespace)
    torch.manual_seed(0)
    model = namespace["Net"]()
    x, y = torch.randn(16, 3, 8, 8), torch.randint(10, (16,))
    kept = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers(), x]}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in kept:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    assert loss.requires_grad
    return sum(saved.values())


def test_saved_bytes_of_plain_autograd():
    """The walk over autograd's graph: distinct storages, inputs and parameters left out."""
    weight = torch.nn.Parameter(torch.randn(32, 64))
    x = torch.randn(8, 64)
    hidden = x @ weight.t()  # saves x and the weight: both left out
    activated = torch.tanh(hidden)  # saves its 8x32 result
    out = (activated * activated).sum()  # saves `activated` twice: once
    excluded = {x.untyped_storage()._cdata, weight.untyped_storage()._cdata}
    assert saved_tensor_bytes([out], excluded) == 8 * 32 * 4


def test_the_model_is_compiled_after_its_optimizer():
    code = compile_inserted(SCRIPT, "train.py")
    lines = [line.strip() for line in code.splitlines()]
    at = lines.index("optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)")
    assert lines[at + 1] == "__memadvisor_compile__(model)"
    assert code.count("__memadvisor_compile__") == 1


def test_a_script_without_an_optimizer_is_one_line():
    with pytest.raises(UserError) as caught:
        compile_inserted("import torch\nmodel = torch.nn.Linear(2, 2)\n", "plain.py")
    assert "\n" not in str(caught.value) and "optimizer" in str(caught.value)


@pytest.mark.skipif(not has_compiler, reason="inductor needs a C++ compiler on the CPU, "
                    "and this machine has none (no g++, c++ or clang++)")
def test_advise_lists_the_compile_advice_when_asked(profiled):
    env = {**os.environ, "PYTHONPATH": str(CHECKOUT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "memadvisor.cli", "advise", str(profiled),
                          "--budget", "1GiB", "--compile", "--json"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    import json
    compile_items = [a for a in json.loads(run.stdout)["advice"] if a["kind"] == "compile"]
    assert len(compile_items) == 1
    item = compile_items[0]
    details = item["details"]
    # the figures are compile_saving's: two graphs, one break, a saving only if it lowers
    # the peak
    assert details["graphs"] == 2 and sum(details["graph_breaks"].values()) == 1
    lowered = details["eager_peak_bytes"] - details["predicted_peak_bytes"]
    assert item["bytes_saved"] == (max(lowered, 0) if item["status"] == "suggested" else 0)
    assert item["status"] in ("suggested", "info")


def test_compile_advice_that_cannot_run_says_why(monkeypatch, tmp_path):
    from memadvisor.advice import MISSING
    from memadvisor.advice import compile_saving as module
    from memadvisor.advice.compile_advice import compile_advice

    def refuse(path, method="fake"):
        raise UserError(f"{path}: the compile advice predicts CPU runs only so far")
    monkeypatch.setattr(module, "compile_saving", refuse)
    (item,) = compile_advice(tmp_path / "gpu.trace", "train.py")
    assert item.status == MISSING and item.bytes_saved == 0
    assert "CPU runs only" in item.reason and item.location == "train.py"
