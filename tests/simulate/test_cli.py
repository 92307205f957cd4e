import json

import pytest

from memadvisor.cli import main
from memadvisor.plan import Plan
from memadvisor.trace import TraceMeta, events_table, write_trace
from memadvisor.trace.schema import COLUMN_NAMES


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_simulate_json_has_the_contract_keys(capsys, baseline_file):
    code, out, _ = run(capsys, "simulate", baseline_file, "--plan", "checkpoint=auto,accum=2",
                       "--json")
    assert code == 0
    data = json.loads(out)
    for key in ("peak_bytes", "reserved_bytes", "by_category", "step_time_factor", "terms",
                "changes", "cost_terms"):
        assert key in data
    assert data["peak_bytes"] < data["baseline_peak_bytes"]
    assert sum(data["by_category"].values()) == data["peak_bytes"]
    assert data["step_time_factor"] > 1.0  # recompute costs time


def test_simulate_text_names_the_terms(capsys, baseline_file):
    code, out, _ = run(capsys, "simulate", baseline_file, "--plan",
                       "shard=zero3,world=4", "--gpu", "h100")
    assert code == 0
    assert "optimizer state" in out and "zero3 over 4 ranks" in out
    assert "reserved" in out


def test_advise_json_ranks_plans_and_saves_the_best(capsys, baseline_file, base, tmp_path):
    plan_file = tmp_path / "plan.json"
    budget = int(base.peak.bytes * 0.8)
    code, out, _ = run(capsys, "advise", baseline_file, "--budget", str(budget), "--gpus", "2",
                       "--json", "--save-plan", str(plan_file))
    assert code == 0
    data = json.loads(out)
    assert data["plans"]
    for plan in data["plans"]:
        assert {"plan", "peak_bytes", "reserved_bytes", "step_time_factor"} <= set(plan)
        assert plan["peak_bytes"] <= data["usable_bytes"]
    # ranked by the default objective, cost: GPU-time per step (the factor shown times
    # the GPUs, to 3 digits; ties to the plan with fewer techniques, so the raw factors
    # alone need not be sorted: x0.5001 on 2 GPUs ties x0.5 on 2)
    costs = [round(round(p["step_time_factor"], 4) * p["plan"]["world"], 3)
             for p in data["plans"]]
    assert costs == sorted(costs)
    saved = Plan.from_json_file(str(plan_file))
    assert saved.to_compact() == data["plans"][0]["plan_compact"]
    # no semantics-changing plan unless allowed
    assert all(p["plan"]["optimizer"] == "keep" and p["plan"]["precision"] != "bf16"
               for p in data["plans"])


def test_advise_proposes_semantic_changes_only_when_allowed(capsys, baseline_file, base):
    budget = str(int(base.peak.bytes * 0.75))
    _, out, _ = run(capsys, "advise", baseline_file, "--budget", budget, "--allow",
                    "optimizer,bf16", "--top", "200", "--json")
    plans = json.loads(out)["plans"]
    assert any(p["plan"]["optimizer"] != "keep" for p in plans)
    assert any(any("TRAINING SEMANTICS" in c for c in p["changes"]) for p in plans)


@pytest.mark.parametrize("argv, message", [
    (["simulate", "{trace}", "--plan", "precison=bf16"], "unknown plan key 'precison'"),
    (["advise", "{trace}", "--budget", "1KiB"], "no plan fits 1 KiB"),
    (["advise", "{trace}", "--budget", "lots"], "not a size"),
    (["simulate", "{trace}", "--gpu", "h900"], "unknown GPU"),
    (["simulate", "/nonexistent.trace"], "no such trace file"),
])
def test_bad_input_is_one_line(capsys, baseline_file, argv, message):
    code, _, err = run(capsys, *[a.format(trace=baseline_file) for a in argv])
    assert code == 2
    assert message in err and err.count("\n") == 1


def test_trace_of_a_failed_run_is_refused(capsys, tmp_path):
    path = tmp_path / "failed.trace"
    write_trace(path, events_table({name: [] for name in COLUMN_NAMES}),
                TraceMeta(status="error", error="CUDA out of memory", steps_completed=0))
    code, _, err = run(capsys, "simulate", str(path))
    assert code == 2
    assert "completed no training step" in err and "CUDA out of memory" in err
    assert err.count("\n") == 1


def test_a_script_that_fits_is_told_to_change_nothing(capsys, baseline_file, base, tmp_path):
    plan_file = tmp_path / "plan.json"
    budget = str(int(base.peak.bytes * 3))
    code, out, _ = run(capsys, "advise", baseline_file, "--budget", budget, "--gpus", "2",
                       "--json", "--save-plan", str(plan_file))
    assert code == 0
    data = json.loads(out)
    assert data["keep_as_is"] and data["best"] is None
    assert Plan.from_json_file(str(plan_file)).to_compact() == Plan().to_compact()
    _, text, _ = run(capsys, "advise", baseline_file, "--budget", budget)
    assert "best: change nothing" in text
    # asked for an objective, it ranks plans as usual
    code, out, _ = run(capsys, "advise", baseline_file, "--budget", budget, "--objective",
                       "memory", "--json")
    data = json.loads(out)
    assert not data["keep_as_is"] and data["best"] == 0
    peaks = [p["reserved_bytes"] or p["peak_bytes"] for p in data["plans"]]
    assert peaks == sorted(peaks)


def test_more_gpus_cost_gpu_time_unless_speed_is_asked_for(capsys, baseline_file, base):
    budget = str(int(base.peak.bytes * 3))
    ranked = {}
    for objective in ("cost", "speed"):
        code, out, _ = run(capsys, "advise", baseline_file, "--budget", budget, "--gpus", "4",
                           "--objective", objective, "--json", "--top", "40")
        assert code == 0
        ranked[objective] = json.loads(out)["plans"]
    # ranked as the search rounds them (equal to 3 digits: the simpler plan first)
    cost = [round(p["step_time_factor"] * p["plan"]["world"], 3) for p in ranked["cost"]]
    assert cost == sorted(cost)
    speed = [round(p["step_time_factor"], 3) for p in ranked["speed"]]
    assert speed == sorted(speed)
    # the fastest plan uses every GPU; the cheapest in GPU-time does not
    assert ranked["speed"][0]["plan"]["world"] == 4
    assert ranked["cost"][0]["plan"]["world"] < 4
