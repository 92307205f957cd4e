"""Predictions made without a GPU against what a real H100 measured.

    python benchmarks/gpu_real/compare.py [--only REGEX] [--jobs N] [--json OUT] [--keep DIR]

The truth is tests/fixtures/gpu_h100/truth.json (recorded 2026-11-25 on an H100 80GB HBM3
by run_on_gpu.sh + record.py: per optimizer step, torch's own max_memory_allocated and
max_memory_reserved, nothing of memadvisor in the process).  For every case this script,
on this CPU-only machine:

- executed: writes the case's plan script with ``memadvisor apply --no-run`` (plan cases)
  and runs it under ``memadvisor profile --fake --gpu h100-80gb`` (fake tensors on a
  simulated H100, the apply runtime applying the plan), then replays the trace through
  the caching-allocator model: each step's peak allocated and reserved;
- analytic (plan cases): ``memadvisor simulate BASE.trace --plan PLAN --gpu h100-80gb``
  on the base case's executed trace.

It compares the worst step of each (the figure that decides whether a run fits) with the
GPU's, and prints the table and its summary.  Signed errors: positive = predicted more
than the GPU used; negative (under-prediction) is the dangerous direction.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(CHECKOUT))
TRUTH = CHECKOUT / "tests" / "fixtures" / "gpu_h100" / "truth.json"
H100_TOTAL_BYTES = 85_017_755_648
MiB = 2**20


def _memadvisor(*args: str, timeout_s: float = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(CHECKOUT), "OMP_NUM_THREADS": "1"}
    env.pop("CUBLAS_WORKSPACE_CONFIG", None)
    return subprocess.run([sys.executable, "-m", "memadvisor.cli", *args], cwd=CHECKOUT,
                          env=env, capture_output=True, text=True, timeout=timeout_s)


def plan_as_run(case: dict) -> str:
    """The plan the GPU ran: where a plan's meaning changed since it was recorded
    (checkpoint=auto now takes every stack of repeated blocks), the case records the
    modules it resolved to then (``plan_as_run``)."""
    return case.get("plan_as_run") or case["plan"]


def executed(name: str, case: dict, folder: Path) -> dict:
    """Run the case on fake tensors; its worst step's modelled peaks."""
    from memadvisor.commands.profile_fake import modelled_step_peaks
    script = case["script"]
    if case["plan"]:
        script = str(folder / f"{name}.py")
        proc = _memadvisor("apply", case["script"], "--plan", plan_as_run(case), "--no-run", "-q",
                           "-o", script)
        if proc.returncode:
            return {"error": "apply: " + proc.stderr.strip().splitlines()[-1]}
    trace = folder / f"{name}.trace"
    proc = _memadvisor("profile", "--fake", "--gpu", "h100-80gb", script, "-o", str(trace),
                       "--steps", "0", "--", *case["args"].split())
    if proc.returncode:
        lines = proc.stderr.strip().splitlines()
        return {"error": "profile --fake: " + (lines[-1] if lines else f"exit {proc.returncode}")}
    steps, _ = modelled_step_peaks(trace, "cuda:0", H100_TOTAL_BYTES)
    return {"allocated": max(s.peak_allocated_bytes for s in steps),
            "reserved": max(s.peak_reserved_bytes for s in steps), "trace": str(trace)}


def analytic(base_trace: str, plan: str) -> dict:
    proc = _memadvisor("simulate", base_trace, "--plan", plan, "--gpu", "h100-80gb", "--json")
    if proc.returncode:
        return {"error": "simulate: " + proc.stderr.strip().splitlines()[-1]}
    result = json.loads(proc.stdout)
    return {"allocated": result["allocated_bytes"], "reserved": result["reserved_bytes"]}


def error_pct(predicted: int, measured: int) -> float:
    return 100.0 * (predicted - measured) / measured


def summary(label: str, errors: list[float]) -> str:
    if not errors:
        return f"{label}: no cases"
    absolute = sorted(abs(e) for e in errors)
    under = [e for e in errors if e < -1.0]
    return (f"{label}: {len(errors)} cases, median |error| {statistics.median(absolute):.2f}%, "
            f"worst {max(errors, key=abs):+.2f}%, within 2%: "
            f"{sum(e <= 2 for e in absolute)}, within 5%: {sum(e <= 5 for e in absolute)}, "
            f"under by more than 1%: {len(under)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="regex on case names")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--keep", help="keep traces and plan scripts in this folder")
    args = parser.parse_args()
    truth = json.loads(TRUTH.read_text())
    cases = {name: case for name, case in truth["cases"].items()
             if re.search(args.only, name)}
    folder = Path(args.keep or tempfile.mkdtemp(prefix="gpu_compare_"))
    folder.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(args.jobs) as pool:
        runs = dict(zip(cases, pool.map(lambda item: executed(item[0], item[1], folder),
                                        cases.items())))
    rows = []
    for name, case in cases.items():
        measured_allocated = max(step[0] for step in case["steps"])
        measured_reserved = max(step[1] for step in case["steps"])
        row = {"case": name, "plan": case["plan"] or "(as written)",
               "measured_allocated": measured_allocated, "measured_reserved": measured_reserved,
               "executed": runs[name]}
        base = runs.get(name.split("__")[0], {})
        if case["plan"] and "trace" in base:
            row["analytic"] = analytic(base["trace"], plan_as_run(case))
        rows.append(row)
    print("| case | plan | H100 allocated MiB | executed | analytic | H100 reserved MiB | "
          "executed | analytic |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    errors: dict[str, list[float]] = {k: [] for k in ("ea", "er", "aa", "ar")}
    for row in rows:
        cells = []
        for kind, short in (("allocated", "a"), ("reserved", "r")):
            measured = row[f"measured_{kind}"]
            cells.append(f"{measured / MiB:,.1f}")
            for source, prefix in (("executed", "e"), ("analytic", "a")):
                result = row.get(source)
                if result is None:
                    cells.append("")
                elif "error" in result:
                    cells.append("fails")
                else:
                    err = error_pct(result[kind], measured)
                    errors[prefix + short].append(err)
                    cells.append(f"{err:+.2f}%")
        print(f"| {row['case']} | {row['plan']} | " + " | ".join(cells) + " |")
    print()
    print(summary("executed, peak allocated", errors["ea"]))
    print(summary("executed, peak reserved", errors["er"]))
    print(summary("analytic, peak allocated", errors["aa"]))
    print(summary("analytic, peak reserved", errors["ar"]))
    failures = [(row["case"], row["executed"]["error"]) for row in rows
                if "error" in row["executed"]]
    for case, message in failures:
        print(f"executed run failed: {case}: {message}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
