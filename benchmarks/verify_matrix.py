"""The zoo's accuracy matrix: analytic, executed and measured peaks, script x plan.

    python benchmarks/verify_matrix.py                          # every zoo script x PLANS
    python benchmarks/verify_matrix.py --only vae,moe --plans accum=2,shard=zero2,world=2
    python benchmarks/verify_matrix.py --markdown docs/ACCURACY_ZOO.md --json out.json
    python benchmarks/verify_matrix.py --measured-from docs/ACCURACY.md --skip-executed   # re-predict only

Per zoo script (``zoo/``, run with its defaults): one real profile on this CPU (3 steps),
then per plan, all through the CLI a user has:

* **analytic**: ``simulate TRACE --plan P --json`` (the cpu target): ``peak_bytes``;
* **executed**: ``simulate ... --verify --verify-by fake``: the script rewritten by
  ``apply`` and run on fake CPU tensors (ranks 0 and the last on a fake process group),
  its last step's peak (each op's CPU kernel blocks measured on this machine, docs/FAKE.md);
* **measured**: ``simulate ... --verify --verify-by real``: the same rewrite run for real
  (``apply --profile``; torchrun on gloo for several ranks), the worst rank's last-step
  peak.  FSDP plans (zero2/zero3) measure ``--fsdp-runs`` times and keep the highest
  (gloo's worker thread frees collective buffers at a time the scheduler picks);
* **gpu**: with ``--gpu NAME`` also the analytic and the fake-executed peak on that GPU
  (reserved bytes through the allocator model; nothing here can measure a GPU).

* **advise** (``--advise FRACTION``): per script, ``advise --budget B --gpus 2`` with B =
  FRACTION x the script's own peak, then the plan it recommends (``best``: the first shown
  that fits and that ``apply`` can realise) measured as above (FSDP: the highest of
  ``--fsdp-runs``): a plan declared to fit must measure at most 1% above B.

Errors are (prediction - measured) / measured.  A case ``apply`` refuses, or whose run
fails, is listed with its one-line reason and left out of the error statistics (counted).
Prints a Markdown table and the median / worst errors per column.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "zoo"))

from zoo_scripts import quiet_environment, zoo_scripts  # noqa: E402

PLANS = ["precision=amp-bf16", "checkpoint=auto", "accum=2", "optimizer=sgd",
         "precision=amp-bf16,checkpoint=auto,accum=2", "shard=ddp,world=2",
         "shard=zero2,world=2", "shard=zero3,world=2"]
FSDP = ("shard=zero2", "shard=zero3")


def _cli(*args, cwd, timeout_s=900) -> subprocess.CompletedProcess:
    env = {**quiet_environment(), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "memadvisor.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout_s)


def _last_line(proc) -> str:
    lines = [line for line in (proc.stderr or proc.stdout).strip().splitlines() if line]
    return lines[-1].removeprefix("memadvisor: error: ")[:240] if lines else \
        f"exit {proc.returncode}"


def _simulate(trace: Path, plan: str, *options) -> tuple[dict | None, str]:
    proc = _cli("simulate", str(trace), "--plan", plan, "--json", *options, cwd=trace.parent)
    if not proc.stdout.strip().startswith("{"):
        return None, _last_line(proc)
    data = json.loads(proc.stdout)
    record = data.get("verification")
    if record is not None and not record["executed"]:
        return data, record["refused"] or record["failed"]
    return data, ""


def measured_runs(trace: Path, plan: str, fsdp_runs: int) -> tuple[list[int], str]:
    """The plan run for real (``apply --profile``): the worst rank's peak of each run --
    ``fsdp_runs`` runs for FSDP plans (gloo frees collective buffers when its thread is
    scheduled) -- or the reason it could not be measured."""
    peaks = []
    for _ in range(fsdp_runs if plan.startswith(FSDP) else 1):
        real, why = _simulate(trace, plan, "--verify", "--verify-by", "real")
        if why:
            return peaks, why
        peaks.append(real["verification"]["executed_peak_bytes"])
    return peaks, ""


def gpu_case(script, trace: Path, plan: str, gpu: str) -> dict:
    """``--gpu-only``: the analytic and the fake-executed peak on ``gpu`` (nothing here can
    measure a GPU: the executed figure is the reference)."""
    row = {"script": script.name, "plan": plan}
    on_gpu, why = _simulate(trace, plan, "--gpu", gpu, "--verify")
    if on_gpu is None or why:
        return {**row, "skipped": why}
    record = on_gpu["verification"]
    return {**row, "gpu_analytic": record["analytic_peak_bytes"],
            "gpu_executed": record["executed_peak_bytes"],
            "gpu_analytic_allocated": record["analytic_allocated_bytes"],
            "gpu_executed_allocated": record["executed_allocated_bytes"],
            "worst_rank": record["worst_rank"], "seconds": record["seconds"]}


def gpu_markdown(rows: list[dict], gpu: str, command: str) -> str:
    done = [r for r in rows if "gpu_executed" in r]
    out = [f"Date: {datetime.date.today()}.  Machine: {platform.machine()} CPU, "
           f"{os.cpu_count()} cores; target {gpu} (fake execution); command: `{command}`.", ""]
    for what, a, e in (("reserved", "gpu_analytic", "gpu_executed"),
                       ("allocated", "gpu_analytic_allocated", "gpu_executed_allocated")):
        errors = [(r[a] - r[e]) / r[e] for r in done]
        if errors:
            under = sum(x < -0.01 for x in errors)
            out.append(f"- analytic vs executed **{what}** over {len(done)} cases: median "
                       f"|error| {statistics.median(abs(x) for x in errors):.2%}, worst "
                       f"{max(errors, key=abs):+.2%}; {under} under-predict by more than 1%")
    out.append(f"- not executed: {len(rows) - len(done)} of {len(rows)} cases (reasons below)")
    out += ["", "| script | plan | executed reserved | analytic | executed allocated | analytic |",
            "|---|---|---:|---:|---:|---:|"]
    for r in done:
        out.append(f"| {r['script']} | `{r['plan']}` | {r['gpu_executed']:,} | "
                   f"{(r['gpu_analytic'] - r['gpu_executed']) / r['gpu_executed']:+.2%} | "
                   f"{r['gpu_executed_allocated']:,} | "
                   f"{(r['gpu_analytic_allocated'] - r['gpu_executed_allocated']) / r['gpu_executed_allocated']:+.2%} |")
    skipped = [r for r in rows if "skipped" in r]
    if skipped:
        out += ["", "Not executed:", ""]
        out += [f"- {r['script']} `{r['plan']}`: {r['skipped']}" for r in skipped]
    return "\n".join(out) + "\n"


def measured_from(path: Path) -> dict[tuple[str, str], int]:
    """(script, plan) -> measured peak, read from a Markdown table of an earlier run (the
    ``| script | `plan` | measured | ...`` rows this benchmark prints; docs/ACCURACY.md's
    "Every case") or its ``--json`` output."""
    text = path.read_text()
    if path.suffix == ".json":
        return {(r["script"], r["plan"]): r["measured"] for r in json.loads(text)
                if r.get("measured") is not None}
    found = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[1].startswith("`") and cells[2][:1].isdigit():
            found.setdefault((cells[0], cells[1].strip("`")),
                             int(cells[2].split()[0].replace(",", "")))
    return found


def run_case(script, trace: Path, plan: str, gpu: str | None, fsdp_runs: int,
             reference: dict | None = None, skip_executed: bool = False) -> dict:
    row = {"script": script.name, "plan": plan}
    analytic, why = _simulate(trace, plan)
    if analytic is None:
        return {**row, "skipped": why}
    row["analytic"] = analytic["peak_bytes"]
    if reference is not None and (script.name, plan) not in reference:
        return {**row, "skipped": "measured: not in the reference"}
    if skip_executed:
        executed, why = None, "not run (--skip-executed)"
    else:
        executed, why = _simulate(trace, plan, "--verify", "--verify-by", "fake")
    if why and ("cannot rewrite" in why or "PlanError" in why):
        return {**row, "skipped": f"executed: {why}"}  # apply refuses the plan itself
    # a fake run that fails (values it cannot know) leaves the analytic case to measure
    row["executed"] = None if why else executed["verification"]["executed_peak_bytes"]
    row["executed_failed"] = why or None
    if reference is not None:
        # the measurement of an earlier run (apply's side unchanged since): the
        # predictions are made again
        return {**row, "measured": reference[(script.name, plan)]}
    measured, why = measured_runs(trace, plan, fsdp_runs)
    if why:
        return {**row, "skipped": f"measured: {why}"}
    row["measured"] = max(measured)
    row["measured_runs"] = measured
    if gpu:
        on_gpu, why = _simulate(trace, plan, "--gpu", gpu, "--verify")
        row["gpu_analytic"] = on_gpu["peak_bytes"] if on_gpu else None
        row["gpu_executed"] = None if why else on_gpu["verification"]["executed_peak_bytes"]
        row["gpu_note"] = why
    return row


def advise_case(script, trace: Path, fraction: float, fsdp_runs: int) -> dict:
    """``advise`` at ``fraction`` of the script's peak, and its recommended plan measured."""
    from memadvisor.trace.io import read_trace
    from memadvisor.trace.analysis import analysed_step
    meta = read_trace(trace).meta
    budget = int(fraction * meta.steps[analysed_step(read_trace(trace))]["peak_bytes"])
    row = {"script": script.name, "budget_bytes": budget}
    proc = _cli("advise", str(trace), "--budget", str(budget), "--gpus", "2", "--json",
                cwd=trace.parent)
    if not proc.stdout.strip().startswith("{"):
        return {**row, "skipped": f"advise: {_last_line(proc)}"}
    data = json.loads(proc.stdout)
    if data.get("best") is None or not data.get("plans"):
        return {**row, "skipped": "advise: no plan fits"}
    shown = data["plans"][data["best"]]
    plan = shown["plan_compact"]
    row.update(plan=plan, predicted=shown["peak_bytes"])
    measured, why = measured_runs(trace, plan, fsdp_runs)
    if why:
        return {**row, "skipped": f"measured: {why}"}
    row["measured"] = max(measured)
    row["over_budget"] = (row["measured"] - budget) / budget
    return row


def advise_markdown(rows: list[dict], fraction: float) -> str:
    done = [r for r in rows if "measured" in r]
    out = ["", f"`advise --budget {fraction:g} x peak --gpus 2`, its recommended plan measured:",
           ""]
    if done:
        worst = max(r["over_budget"] for r in done)
        over = sum(r["over_budget"] > 0.01 for r in done)
        out.append(f"- {len(done)} plans measured: worst {worst:+.2%} against the budget; "
                   f"{over} more than 1% over it")
    out += ["", "| script | budget | plan | predicted | measured | vs budget |",
            "|---|---:|---|---:|---:|---:|"]
    out += [f"| {r['script']} | {r['budget_bytes']:,} | `{r['plan']}` | {r['predicted']:,} | "
            f"{r['measured']:,} | {r['over_budget']:+.2%} |" for r in done]
    out += [f"- {r['script']}: {r['skipped']}" for r in rows if "skipped" in r]
    return "\n".join(out) + "\n"


def _error(row, key):
    return (row[key] - row["measured"]) / row["measured"]


def markdown(rows: list[dict], gpu: str | None, command: str) -> str:
    done = [r for r in rows if "measured" in r]
    out = [f"Date: {datetime.date.today()}.  Machine: {platform.machine()} CPU, "
           f"{os.cpu_count()} cores, {platform.processor() or platform.platform()}; "
           f"command: `{command}`.", ""]
    for key in ("analytic", "executed"):
        errors = [abs(_error(r, key)) for r in done if r.get(key) is not None]
        if errors:
            out.append(f"- **{key}** vs measured over {len(done)} cases: median "
                       f"{statistics.median(errors):.2%}, worst {max(errors):.2%}")
    out.append(f"- not measured: {len(rows) - len(done)} of {len(rows)} cases (reasons below)")
    out += ["", "| script | plan | measured | analytic | executed (fake) |"
            + (f" {gpu} analytic | {gpu} executed |" if gpu else ""),
            "|---|---|---:|---:|---:|" + ("---:|---:|" if gpu else "")]
    for r in done:
        executed = (f"{_error(r, 'executed'):+.2%}" if r.get("executed") is not None else
                    "failed")
        line = (f"| {r['script']} | `{r['plan']}` | {r['measured']:,} | "
                f"{_error(r, 'analytic'):+.2%} | {executed} |")
        if gpu:
            line += (f" {r.get('gpu_analytic') or '-':,} | "
                     f"{r.get('gpu_executed') or r.get('gpu_note') or '-'} |"
                     if isinstance(r.get("gpu_analytic"), int) else " - | - |")
        out.append(line)
    skipped = [r for r in rows if "skipped" in r]
    if skipped:
        out += ["", "Not measured:", ""]
        out += [f"- {r['script']} `{r['plan']}`: {r['skipped']}" for r in skipped]
    return "\n".join(out) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated zoo script names")
    parser.add_argument("--plans", help="semicolon-separated plans [default: PLANS]")
    parser.add_argument("--gpu", help="also predict and execute on this GPU (e.g. h100-80gb)")
    parser.add_argument("--gpu-only", action="store_true",
                        help="with --gpu: only the GPU's analytic and executed peaks")
    parser.add_argument("--fsdp-runs", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--keep", type=Path, help="folder for the traces (reused)")
    parser.add_argument("--advise", type=float, metavar="FRACTION",
                        help="only: advise at FRACTION of each script's peak, its plan measured")
    parser.add_argument("--measured-from", type=Path, metavar="FILE",
                        help="reuse the measured peaks of an earlier run (its --json, or a "
                             "Markdown table such as docs/ACCURACY.md's 'Every case') and "
                             "only predict again (with --skip-executed: minutes instead of "
                             "an hour)")
    parser.add_argument("--skip-executed", action="store_true",
                        help="leave out the fake-CPU execution (analytic and measured only)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    options = parser.parse_args()
    if options.gpu_only and not options.gpu:
        parser.error("--gpu-only needs --gpu NAME")
    names = set(options.only.split(",")) if options.only else None
    plans = options.plans.split(";") if options.plans else PLANS
    scripts = [s for s in zoo_scripts() if (names is None or s.name in names)
               and not s.missing_package()]
    reference = measured_from(options.measured_from) if options.measured_from else None
    folder = options.keep or Path(tempfile.mkdtemp(prefix="verify-matrix-"))
    folder.mkdir(parents=True, exist_ok=True)
    rows = []

    def one_script(script):
        trace = folder / f"{script.name}.trace"
        if not trace.exists():
            proc = _cli("profile", str(script.path), "-o", str(trace), "--steps", "3", "-q",
                        cwd=ROOT)
            if proc.returncode:
                return [{"script": script.name, "plan": p,
                         "skipped": f"profile: {_last_line(proc)}"} for p in plans]
        if options.advise:
            row = advise_case(script, trace, options.advise, options.fsdp_runs)
            print(json.dumps(row), flush=True)
            return [row]
        out = []
        for plan in plans:
            row = (gpu_case(script, trace, plan, options.gpu) if options.gpu_only else
                   run_case(script, trace, plan, options.gpu, options.fsdp_runs, reference,
                            options.skip_executed))
            print(json.dumps(row), flush=True)
            out.append(row)
        return out

    with ThreadPoolExecutor(max_workers=options.jobs) as pool:
        for result in pool.map(one_script, scripts):
            rows += result
    command = "python benchmarks/verify_matrix.py " + " ".join(sys.argv[1:])
    text = (gpu_markdown(rows, options.gpu, command.strip()) if options.gpu_only else
            advise_markdown(rows, options.advise) if options.advise else
            markdown(rows, options.gpu, command.strip()))
    print(text)
    if options.json:
        options.json.write_text(json.dumps(rows, indent=1))
    if options.markdown:
        options.markdown.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
