"""The in-place advice measured (issue 14's Done-when): its suggested lines are edited in a
copy of a script (benchmarks/inplace_advice.py), both are profiled, and the measured drop
of the peak is the predicted one; a refused change applied makes autograd raise.  Also
how ``advise`` shows the advice.  ~20 s: two profiles and a run of a small script, advise."""
import importlib.util
import json
import os
from pathlib import Path

import pytest

from memadvisor.cli import main

HERE = Path(__file__).parent
SCRIPT = HERE / "scripts" / "inplace_chain.py"
BENCHMARK = HERE.parents[1] / "benchmarks" / "inplace_advice.py"


def benchmark():
    spec = importlib.util.spec_from_file_location("inplace_advice_benchmark", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    folder = tmp_path_factory.mktemp("inplace_measured")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return benchmark().measure(str(SCRIPT), steps=3, folder=str(folder), refused=True), folder


def test_the_measured_peak_drop_is_the_predicted_one(measured):
    result, _ = measured
    assert result["unedited"] == []
    assert sorted(result["edits"].values()) == ["h -= 1.0", "h = F.relu(h, inplace=True)"]
    # the two 1 MiB moments go together: 768 KiB off a 3.4 MiB peak
    assert result["predicted_drop_bytes"] > 512 * 1024
    assert result["measured_drop_bytes"] == pytest.approx(result["predicted_drop_bytes"],
                                                          rel=0.02)


def test_the_refused_residual_makes_autograd_raise_when_applied(measured):
    result, _ = measured
    checked = {r["location"].rsplit(":", 1)[1]: r for r in result["refused_checked"]}
    residual = checked["20"]  # out = out + self.fc2(out): fc2 saved out
    assert residual["edit"] == "out += self.fc2(out)"
    assert residual["exit"] != 0 and residual["autograd_refused"]
    assert "saved it for backward" in residual["reason"]


@pytest.mark.parametrize("line, op, edited", [
    ("    h = F.relu(h)\n", "aten::relu", "    h = F.relu(h, inplace=True)\n"),
    ("    h = F.silu(self.fc(h))\n", "aten::silu", "    h = F.silu(self.fc(h), inplace=True)\n"),
    ("    x = x + self.attn(x)\n", "aten::add", "    x += self.attn(x)\n"),
    ("    x = y + x\n", "aten::add", None),  # not `x = x + ...`: no edit known
    ("    h = F.relu(h, inplace=False)\n", "aten::relu", None),
    ("    h = h.relu()\n", "aten::relu", "    h = h.relu_()\n"),
])
def test_the_benchmark_edits_the_forms_it_knows(line, op, edited):
    assert benchmark().edit_line(line, op) == edited


def test_advise_lists_the_advice_after_the_plans(measured, capsys):
    _, folder = measured
    trace = str(folder / "original.trace")
    code = main(["advise", trace, "--budget", "1GiB", "--verify", "0", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    kinds = {(a["kind"], a["status"]) for a in data["advice"]}
    assert ("inplace", "suggested") in kinds and ("inplace", "refused") in kinds
    lines = {a["location"].rsplit(":", 1)[-1] for a in data["advice"] if a["location"]}
    assert {"16", "17", "18", "20"} <= lines  # scale (x: the batch), shift, relu, residual
    main(["advise", trace, "--budget", "1GiB", "--verify", "0"])
    text = capsys.readouterr().out
    section = text.index("advice beyond plans")
    assert text.index("best:") < section  # after the plan table and the best plan
    assert "inplace_chain.py:18" in text[section:]
