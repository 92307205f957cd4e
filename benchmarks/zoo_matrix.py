"""The real-world matrix: memadvisor on every zoo script (``zoo/``), four cells each.

    python benchmarks/zoo_matrix.py                      # everything; writes docs/ZOO.md
    python benchmarks/zoo_matrix.py --only vae,dcgan --no-write
    python benchmarks/zoo_matrix.py --from-json results.json   # re-render saved results

Per script, against the ground truth of its ``# zoo:`` header (tests/zoo/zoo_scripts.py):

* ``profile``: ``memadvisor profile SCRIPT --steps 3``; compares ``meta.batch.batch_size``,
  ``steps_completed`` and the iterations the script really ran (its ``iter N`` lines; the
  run stops at the 3rd step, before or after that iteration's line) with the header, and
  checks every complete step holds forward, backward and (with ``torch.optim``) optimizer
  events.
* ``advise``: ``memadvisor advise TRACE --budget <half the measured peak> --json``; checks
  each ranked plan's micro-batch against the header's batch, and that ``apply --dry-run``
  accepts the top plan (a plan ``advise`` recommends and ``apply`` refuses, with no caveat
  in the output, is wrong).
* ``accum``: ``memadvisor apply SCRIPT --plan accum=2`` in one process (with ``--steps 3``
  when ``apply`` has it) and ``--save-parameters``: the script's whole run, as a user runs it.
  Its final parameters are compared with the unmodified run's (a global forward hook keeps
  each root module the unmodified script calls): within 1e-4 for scripts whose header says
  splitting the batch is exact, only "not diverged" (< 0.5) for the others (dropout drawn
  per micro-batch, BatchNorm, per-token means: the header's ``split_note``).  A final loss
  equal to the unmodified run's on every rank means the batch was not split.  Then the same
  command with ``--profile --profile-steps 3`` gives the plan's signature: the applied
  trace's batch is half the header's.
* ``zero2``: ``memadvisor apply SCRIPT --plan shard=zero2,world=2 --nproc 2``, likewise; the
  rank traces must also show less than 3/4 of the unmodified run's parameter bytes per rank.

A cell is ``works``, ``refused`` (apply said no before the script ran), ``crashed`` (non-zero
exit: the one-line cause), ``wrong`` (exit 0 but a check above failed: how it was seen) or
``skipped`` (the framework package is missing); an applied run that works plainly but fails
under ``--profile`` is ``crashed`` ("only under apply --profile").  Refusals of plans the
header lists count as failures.  Failures are grouped into classes (``CLASSES``: one root
cause each, matched on the cell's evidence; a cell may have two).  Takes about 20 minutes
on 2 CPU cores (``--jobs 1``).
"""
from __future__ import annotations

import argparse
import json
import re
import runpy
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "zoo"))

from zoo_scripts import (ZooScript, final_loss, iterations_printed,  # noqa: E402
                         quiet_environment, zoo_scripts)

PROFILE_STEPS = 3
CELLS = ("profile", "advise", "accum", "zero2")
#: exact-split scripts must match the unmodified run's parameters within EXACT_TOLERANCE; the
#: others (dropout order, BatchNorm, per-token means) only must not diverge
EXACT_TOLERANCE, DIVERGED = 1e-4, 0.5
SHARDED_FRACTION = 0.75  # a rank holding more than this share of the parameter bytes is unsharded
COMMAND_TIMEOUT_S = 420
#: the day the results were produced (kept in --json files, read back by --from-json)
DATE = time.strftime("%Y-%m-%d", time.gmtime())
MACHINE = "2-core CPU container (x86_64, shared with other jobs), torch 2.13.0+cpu, Python 3.11"

# --- running commands ----------------------------------------------------------------------
def memadvisor(*args: str, cwd: Path, timeout_s: float = COMMAND_TIMEOUT_S) -> dict:
    command = [sys.executable, "-m", "memadvisor.cli", *args]
    started = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=cwd, capture_output=True, text=True,
                              timeout=timeout_s, env=quiet_environment(threads=2))
        rc, out, err = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out, err = 124, _text(exc.stdout), _text(exc.stderr) + f"\ntimed out after {timeout_s:.0f} s"
    return {"rc": rc, "stdout": out, "stderr": err, "seconds": time.perf_counter() - started,
            "command": "memadvisor " + " ".join(args)}


def _text(data) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def apply_has_steps() -> bool:
    done = subprocess.run([sys.executable, "-m", "memadvisor.cli", "apply", "--help"],
                          capture_output=True, text=True, cwd=ROOT)
    return "--steps" in done.stdout.replace("--profile-steps", "")


def one_line_cause(stderr: str) -> str:
    """The line that says why a command failed: memadvisor's error, else the exception."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    for line in lines:
        if line.startswith("memadvisor: error:"):
            return line[len("memadvisor: error:"):].strip()
    exception = re.compile(r"^(\w+\.)*\w*(Error|Exception|Interrupt)\b.*|^torch\.\w+.*Error.*")
    found = [line for line in lines if exception.match(line)]
    if found:
        return found[-1]
    return lines[-1] if lines else "(no output)"


def refusal_lines(stderr: str) -> str:
    """memadvisor's error line and the indented reasons after it."""
    lines = stderr.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("memadvisor: error:")), None)
    if start is None:
        return one_line_cause(stderr)
    kept = [lines[start][len("memadvisor: error:"):].strip()]
    kept += [line.strip() for line in lines[start + 1:start + 6] if line.startswith("  ")]
    return " / ".join(kept)


# --- traces --------------------------------------------------------------------------------
def trace_meta(path: Path) -> dict:
    import pyarrow.parquet as pq
    return json.loads(pq.read_schema(path).metadata[b"memadvisor"])


def phases_per_step(path: Path) -> dict[int, set[str]]:
    import pyarrow.parquet as pq
    table = pq.read_table(path, columns=["step", "phase"]).to_pandas()
    return {int(step): set(group["phase"]) for step, group in table.groupby("step")}


def rank_traces(path: Path) -> list[Path]:
    return [path] + sorted(path.parent.glob(f"{path.stem}.rank*{path.suffix}"))


# --- the unmodified run's parameters -------------------------------------------------------
def reference_main(script: str, output: str) -> None:
    """Run SCRIPT as ``python SCRIPT`` would, keep every root module it calls (a module called
    while no other module runs), and save each root's named parameters at the end."""
    import torch
    from torch.nn.modules.module import (register_module_forward_hook,
                                         register_module_forward_pre_hook)

    roots, depth = [], [0]

    def enter(module, _inputs):
        if depth[0] == 0 and not any(module is root for root in roots):
            roots.append(module)
        depth[0] += 1

    def leave(_module, _inputs, _output):
        depth[0] = max(0, depth[0] - 1)

    register_module_forward_pre_hook(enter)
    register_module_forward_hook(leave)
    sys.argv = [script]
    sys.path[0] = str(Path(script).resolve().parent)
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise
    saved = [{"type": type(root).__name__,
              "names": [name for name, _ in root.named_parameters()],
              "tensors": [p.detach().clone() for _, p in root.named_parameters()]}
             for root in roots if any(True for _ in root.parameters())]
    torch.save({"roots": saved}, output)


def run_reference(script: ZooScript, folder: Path) -> dict:
    output = folder / f"{script.name}.reference.pt"
    done = subprocess.run([sys.executable, __file__, "--reference", str(script.path), str(output)],
                          cwd=folder, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S,
                          env=quiet_environment(threads=2))
    if done.returncode != 0 or not output.exists():
        raise RuntimeError(f"unmodified {script.name} failed: {one_line_cause(done.stderr)}")
    return {"parameters": output, "final_loss": final_loss(done.stdout)}


def _normalise(name: str) -> str:
    """A parameter's name without the wrappers a plan adds (DDP's ``module.``, FSDP's and
    checkpointing's wrapped modules, torch.compile's ``_orig_mod.``: the runtime's own
    rule) nor the LightningModule's ``model.`` attribute."""
    from memadvisor.apply.frameworks.probe import user_parameter_name
    name = user_parameter_name(name)
    while name.startswith("model."):
        name = user_parameter_name(name[len("model."):])
    return name


def parameter_error(saved_path: Path, reference_path: Path) -> tuple[float | None, str]:
    """Relative error (one vector) of the applied run's saved parameters against the root of
    the unmodified run whose parameter names they match; None and why when they cannot be
    matched."""
    import torch
    saved = torch.load(saved_path)
    applied = dict(zip(map(_normalise, saved["names"]), saved["tensors"]))
    best, best_overlap = None, 0
    for root in torch.load(reference_path)["roots"]:
        reference = dict(zip(map(_normalise, root["names"]), root["tensors"]))
        overlap = len(set(reference) & set(applied))
        if overlap > best_overlap:
            best, best_overlap = (root["type"], reference), overlap
    if best is None:
        return None, f"saved parameter names match no root module of the unmodified run ({list(applied)[:3]})"
    root_type, reference = best
    if set(reference) != set(applied):
        missing = sorted(set(reference) - set(applied))[:3]
        return None, (f"saved {len(applied)} parameters, the unmodified {root_type} has "
                      f"{len(reference)} (missing e.g. {missing})")
    diff = total = 0.0
    for name, expected in reference.items():
        actual = applied[name]
        if tuple(actual.shape) != tuple(expected.shape):
            return None, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        diff += float((actual.double() - expected.double()).pow(2).sum())
        total += float(expected.double().pow(2).sum())
    return (diff ** 0.5) / (total ** 0.5 or 1.0), root_type


# --- the four cells -------------------------------------------------------------------------
def cell(verdict: str, detail: str, **facts) -> dict:
    return {"verdict": verdict, "detail": detail, **facts}


def profile_cell(script: ZooScript, folder: Path) -> tuple[dict, Path | None]:
    trace = folder / f"{script.name}.trace"
    run = memadvisor("profile", str(script.path), "-o", str(trace), "--steps", str(PROFILE_STEPS),
                     cwd=folder)
    if run["rc"] != 0 or not trace.exists():
        return cell("crashed", one_line_cause(run["stderr"]), rc=run["rc"]), trace if trace.exists() else None
    meta = trace_meta(trace)
    truth = script.truth
    problems = []
    batch = (meta.get("batch") or {}).get("batch_size")
    if batch != truth["batch_size"]:
        shapes = (meta.get("batch") or {}).get("shapes")
        problems.append(f"batch_size {batch} (truth {truth['batch_size']}; shapes {shapes})")
    completed = meta.get("steps_completed")
    if completed != PROFILE_STEPS:
        problems.append(f"steps_completed {completed} of {PROFILE_STEPS} "
                        f"(the script ran {iterations_printed(run['stdout'])} iterations)")
    iterations = iterations_printed(run["stdout"])
    if completed == PROFILE_STEPS and iterations < PROFILE_STEPS - 1:
        problems.append(f"stopped after {iterations} iteration(s): {PROFILE_STEPS} steps counted "
                        f"in {iterations + 1} iteration(s)")
    wanted = {"forward", "backward"} | ({"optimizer"} if truth["optimizers"] else set())
    steps = phases_per_step(trace)
    unlabelled = [s for s in range(completed or 0) if not wanted <= steps.get(s, set())]
    if unlabelled:
        missing = sorted(wanted - steps.get(unlabelled[0], set()))
        problems.append(f"step {unlabelled[0]} has no {'/'.join(missing)} events "
                        f"({len(unlabelled)} of {completed} steps)")
    facts = {"batch_size": batch, "steps_completed": completed, "iterations_run": iterations,
             "step_detection": meta.get("step_detection"), "status": meta.get("status"),
             "parameter_bytes": meta.get("parameter_bytes")}
    if meta.get("status") != "completed":
        problems.append(f"status {meta.get('status')}: {meta.get('error')}")
    if problems:
        return cell("wrong", "; ".join(problems), **facts), trace
    return cell("works", f"batch {batch}, {completed} steps, phases labelled", **facts), trace


def advise_cell(script: ZooScript, trace: Path | None, folder: Path) -> dict:
    if trace is None:
        return cell("crashed", "no trace (profile failed)")
    summary = memadvisor("summary", str(trace), "--json", cwd=folder)
    if summary["rc"] != 0:
        return cell("crashed", "summary: " + one_line_cause(summary["stderr"]))
    peak_bytes = json.loads(summary["stdout"])["peak_bytes"]
    budget = f"{peak_bytes // 2}B"
    run = memadvisor("advise", str(trace), "--budget", budget, "--json", cwd=folder)
    notes = []
    # "none of the N plans that fit can be applied to this script": an answer too (each
    # refusal is named in the output), as is "no plan fits"
    answered = ("no plan fits", "plans that fit can be applied")
    if run["rc"] != 0 and any(a in run["stderr"] for a in answered):
        # an answer, not a failure; ask for two GPUs so the top plan can still be checked
        notes.append("nothing fits on 1 GPU; with --gpus 2:")
        run = memadvisor("advise", str(trace), "--budget", budget, "--gpus", "2", "--json",
                         cwd=folder)
        if run["rc"] != 0 and any(a in run["stderr"] for a in answered):
            answer = one_line_cause(run["stderr"])
            impossible = _impossible_split(answer, script.truth["batch_size"])
            if impossible:
                return cell("wrong", f"{impossible} ({answer[:160]})", budget=budget)
            return cell("works", "no plan apply can realise fits half the peak on 1 or 2 "
                        "GPUs (" + answer[:120] + ")", budget=budget)
    if run["rc"] != 0:
        return cell("crashed", " ".join(notes + [one_line_cause(run["stderr"])]), budget=budget)
    answer = json.loads(run["stdout"])
    plans = answer.get("plans") or []
    facts = {"budget": budget, "peak_bytes": peak_bytes, "plans": len(plans)}
    if not plans:
        return cell("works", f"no plan fits {budget} ({answer.get('evaluated')} evaluated)", **facts)
    problems = list(notes)
    batch = script.truth["batch_size"]
    for plan in plans:
        micro = plan.get("micro_batch_size")
        split = _samples_split(plan["plan"])
        if micro is not None and batch % split == 0 and micro != batch // split:
            problems.append(f"{plan['plan_compact']}: micro-batch {micro}, truth "
                            f"{batch // split}")
            break
    top = plans[0]
    facts["top_plan"] = top["plan_compact"]
    caveat = [k for k in top if "apply" in k.lower() or "realis" in k.lower()]
    world = str(top["plan"].get("world", 1))
    dry = memadvisor("apply", str(script.path), "--plan", top["plan_compact"], "--dry-run",
                     "--nproc", world, "-q", cwd=folder)
    if dry["rc"] != 0 and not caveat:
        problems.append(f"top plan {top['plan_compact']} is refused by apply --dry-run, with no "
                        f"caveat: {refusal_lines(dry['stderr'])}")
    if problems[len(notes):]:
        return cell("wrong", " ".join(problems[:len(notes)] + ["; ".join(problems[len(notes):])]),
                    **facts)
    return cell("works", " ".join(notes + [f"top plan {top['plan_compact']} of {len(plans)}; "
                                           f"apply accepts it"]), **facts)


def _samples_split(knobs: dict) -> int:
    """Into how many micro-batches a plan cuts the batch, from its knobs: the data-parallel
    replicas (world over the tp and pp ranks that share one slice), accumulation, and a
    pipeline's micro-batches (M, default P)."""
    tp, pp = knobs.get("tp") or 1, knobs.get("pp") or 1
    replicas = max(1, (knobs.get("world") or 1) // (tp * pp))
    microbatches = (knobs.get("microbatches") or pp) if pp > 1 else 1
    return replicas * (knobs.get("accum") or 1) * microbatches


def _impossible_split(answer: str, batch: int) -> str:
    """A plan named in advise's answer that splits the batch into parts it cannot have."""
    knobs = {key: int(value) for key, value in
             re.findall(r"\b(accum|world|tp|pp|microbatches)=(\d+)", answer)}
    parts = _samples_split(knobs)  # tp and pp ranks share their replica's slice
    if parts > 1 and batch % parts:
        return f"names a plan splitting the batch into {parts} parts; the batch is {batch}"
    return ""


def apply_cell(script: ZooScript, plan: str, nproc: int, folder: Path, reference: dict,
               baseline: dict, steps_flag: bool) -> dict:
    slug = re.sub(r"\W+", "_", plan)
    rewritten = folder / f"{script.name}__{slug}.py"
    saved = folder / f"{script.name}__{slug}.pt"
    trace = folder / f"{script.name}__{slug}.trace"
    base = ["apply", str(script.path), "--plan", plan, "-o", str(rewritten), "-q"]
    if nproc > 1:
        base += ["--nproc", str(nproc)]
    if steps_flag:
        base += ["--steps", str(script.truth["iterations"])]
    run = memadvisor(*base, "--save-parameters", str(saved), cwd=folder)
    if run["rc"] != 0:
        if _refused(run):
            return cell("refused", refusal_lines(run["stderr"]), rc=run["rc"])
        return cell("crashed", one_line_cause(run["stderr"]), rc=run["rc"])
    problems, notes = [], []
    if not saved.exists():
        problems.append("prepare never ran: no parameters saved, no plan applied")
    else:
        error, matched = parameter_error(saved, reference["parameters"])
        if error is None:
            problems.append(matched)
        elif script.truth["exact_split"] and error > EXACT_TOLERANCE:
            problems.append(f"final parameters differ from the unmodified run's by {error:.2e} "
                            f"(limit {EXACT_TOLERANCE:.0e})")
        elif not script.truth["exact_split"] and not error < DIVERGED:
            problems.append(f"final parameters diverged from the unmodified run's ({error:.2e})")
        elif script.truth["exact_split"]:
            notes.append(f"parameters within {error:.1e} of the unmodified run")
        else:
            notes.append(f"parameters {error:.1e} from the unmodified run (not exact by design: "
                         f"{script.truth['split_note']})")
    losses = [float(x) for x in re.findall(r"final_loss=([-+0-9.eE]+)", run["stdout"])]
    # a final loss equal to the unmodified run's on every rank suggests the batch was not
    # split -- unless the script reports the mean over the micro-batches (HF Trainer does),
    # which an exact split leaves equal: the applied trace's batch decides below
    same_loss = reference["final_loss"] is not None and losses and all(
        abs(x - reference["final_loss"]) <= 1e-6 * max(1.0, abs(x)) for x in losses)
    # the plan's signature, from the same command profiled for the script's first 3 steps
    # (a whole-run trace would end with whatever the script does after training)
    profiled = memadvisor(*base, "--profile", str(trace), "--profile-steps", str(PROFILE_STEPS),
                          cwd=folder)
    if profiled["rc"] != 0:
        return cell("crashed", f"only under apply --profile: {one_line_cause(profiled['stderr'])}"
                    + (f" (plain run: {'; '.join(problems + notes)})" if problems + notes else ""))
    signature = signature_problems(script, plan, nproc, trace, baseline)
    problems += signature
    if same_loss:
        if any("expected the split" in p for p in signature):
            problems.append(f"final loss {losses[0]} identical to the unmodified run's on "
                            f"every rank: the batch was not split")
        else:
            notes.append("final loss equal to the unmodified run's: the script reports the "
                         "mean over micro-batches (the trace shows the split batch)")
    if problems:
        return cell("wrong", "; ".join(problems))
    return cell("works", "; ".join(notes + ["signature in the applied trace"]))


def _refused(run: dict) -> bool:
    """apply said no with its own one-line error (exit 2), the script's code not run or stopped
    by a PlanError before training: no traceback of the script's."""
    return run["rc"] == 2 and "memadvisor: error:" in run["stderr"] and "Traceback" not in run["stderr"]


def signature_problems(script: ZooScript, plan: str, nproc: int, trace: Path,
                       baseline: dict) -> list[str]:
    """What the applied run's trace(s) must show for the plan to have taken effect."""
    traces = [t for t in rank_traces(trace) if t.exists()]
    if len(traces) < nproc:
        return [f"{len(traces)} rank trace(s) written for {nproc} ranks"]
    problems = []
    split = 2  # accum=2, or 2 ranks
    for t in traces:
        meta = trace_meta(t)
        batch = (meta.get("batch") or {}).get("batch_size")
        if script.truth["batch_size"] % split == 0 and batch is not None \
                and batch != script.truth["batch_size"] // split:
            problems.append(f"rank {meta.get('rank', 0)} trace: batch {batch}, expected the "
                            f"split {script.truth['batch_size'] // split}")
            break
    if "zero" in plan and baseline.get("parameter_bytes"):
        per_rank = [trace_meta(t).get("parameter_bytes") or 0 for t in traces]
        if max(per_rank) > SHARDED_FRACTION * baseline["parameter_bytes"]:
            problems.append(f"parameter bytes per rank {per_rank} vs {baseline['parameter_bytes']} "
                            f"unsharded: not sharded")
    return problems


def run_script(script: ZooScript, root: Path, steps_flag: bool) -> dict:
    folder = root / script.name
    folder.mkdir(parents=True, exist_ok=True)
    missing = script.missing_package()
    if missing:
        skipped = cell("skipped", f"{missing} not installed (pip install -e '.[zoo]')")
        return {"script": script.name, "truth": script.truth, **{c: skipped for c in CELLS}}
    started = time.perf_counter()
    row = {"script": script.name, "truth": script.truth}
    reference = run_reference(script, folder)
    row["profile"], trace = profile_cell(script, folder)
    row["advise"] = advise_cell(script, trace, folder)
    baseline = {"parameter_bytes": row["profile"].get("parameter_bytes")}
    row["accum"] = apply_cell(script, "accum=2", 1, folder, reference, baseline, steps_flag)
    row["zero2"] = apply_cell(script, "shard=zero2,world=2", 2, folder, reference, baseline,
                              steps_flag)
    row["seconds"] = round(time.perf_counter() - started, 1)
    print(f"{script.name}: " + ", ".join(f"{c} {row[c]['verdict']}" for c in CELLS)
          + f" ({row['seconds']} s)", file=sys.stderr, flush=True)
    return row


# --- failure classes ----------------------------------------------------------------------
def _apply_cell(cell_name):
    return cell_name in ("accum", "zero2")


def _matches(pattern):
    return lambda truth, cell_name, text: re.search(pattern, text, re.IGNORECASE) is not None


#: (id, predicate(truth, cell name, "cell: detail"), root cause).  A failed cell counts in
#: every class whose predicate holds (one cell can have two causes), except that the
#: EXCLUSIVE classes, when they hold, explain the whole cell (what else it shows follows
#: from them); "other" takes the rest.
CLASSES = [
    ("framework-fsdp-needs-a-gpu",
     _matches(r"needs CUDA GPUs and this machine has none"),
     "the HF Trainer, Lightning and accelerate realise FSDP only on CUDA GPUs (with "
     "`use_cpu=True` the Trainer trains plain DDP, Lightning's `FSDPStrategy` requires a CUDA "
     "accelerator, accelerate with `cpu=True` ignores its FSDP plugin): apply refuses zero2 "
     "before launch on a machine without one, naming the framework; not yet run on a GPU"),
    ("refused-by-design",
     _matches(r"re-evaluates it|an EMA or target network|calls \(lines [\d, ]+\) per iteration|"
              r"trains without it"),
     "plans whose meaning apply cannot keep for this code, refused before anything runs and "
     "naming the line: accumulation inside an LBFGS closure (the optimizer re-evaluates it), "
     "accumulation across a GAN's interleaved backward/step pairs, FSDP with an EMA copy "
     "updated from the sharded parameters, a training loop whose default branch updates "
     "parameters by hand"),
    ("framework-loops",
     lambda truth, c, text: truth["framework"] != "raw" and _apply_cell(c),
     "apply knows one loop shape: a `torch.optim` optimizer assigned in the script, "
     "`loss.backward()`, `optimizer.step()`.  Framework scripts (HF `Trainer`, "
     "`lightning.Trainer`, `accelerate`) have none of them or have them as methods of the "
     "framework: refused (Trainer, Lightning), or rewritten into calls that crash "
     "(`accelerator.backward(loss)` became `mem.backward(accelerator, loss)`; FSDP2 under "
     "accelerate's prepare fails in DTensor sharding propagation).  Issue 13, deliverable 1"),
    ("plan-silently-not-applied",
     _matches(r"prepare never ran|not sharded|identical to the unmodified"),
     "apply exits 0 and the plan did nothing: `mem.prepare` was inserted under the "
     "`if args.use_optimizer:` branch the default run never takes (manual SGD), so accum=2 "
     "and zero2 ran the unmodified training (twice, unsharded, with --nproc 2)"),
    ("seq-first-batch",
     lambda truth, c, text: truth["batch_layout"] == "seq-first"
     and re.search(r"batch_size \d+ \(truth|splitting the batch|attn_mask|batch \d+, expected",
                   text) is not None,
     "the batch is taken to be dimension 0 of the first tensor: sequence-first data gives the "
     "sequence length as the batch (profile), advise then proposes accum=N that cannot "
     "divide the real batch, and apply splits the sequence dimension (the decoder's "
     "attention mask no longer matches)"),
    ("optimizer-not-found",
     _matches(r"did not find (model|optimizer)|\d+ optimizers \(lines"),
     "apply's search wants `NAME = torch.optim.X(MODEL.parameters(), ...)`: parameter-group "
     "lists (Llama's decay/no-decay), an optimizer built by a method "
     "(`model.configure_optimizers`, nanoGPT), or two optimizers (GAN) are refused; "
     "nanoGPT's is also called manual updates"),
    ("step-not-bare",
     _matches(r"no `optimizer\.step\(\)` call|the script scales|\d+ `\.backward\(\)` calls"),
     "apply wants one bare `loss.backward()` and `optimizer.step()`: "
     "`optimizer.step(closure)` (LBFGS), `scaler.scale(loss).backward()` with a GradScaler "
     "(nanoGPT, even disabled) and three backward calls per iteration (DCGAN) are refused"),
    ("advise-recommends-unapplicable",
     _matches(r"refused by apply --dry-run"),
     "advise ranks plans without asking whether apply can realise them for this script: its "
     "top plan is then refused by apply, with no caveat in advise's output"),
    ("profile-batch-from-keywords",
     lambda truth, c, text: c == "profile" and "batch_size None" in text,
     "profile finds no batch when the model is called with keyword arguments "
     "(`model(**batch)`, HF `Trainer`): `meta.batch` is empty, so every plan that splits the "
     "batch is sized without it"),
    ("profile-batch-from-eval-call",
     lambda truth, c, text: c == "profile" and truth["batch_layout"] == "batch-first"
     and re.search(r"batch_size \d+ \(truth", text) is not None,
     "profile takes the batch from a module call that is not training: LBFGS's no-grad "
     "prediction on 3 test sequences between steps gives batch 3 for a batch of 8"),
    ("profile-steps-not-iterations",
     lambda truth, c, text: c == "profile"
     and re.search(r"steps_completed|stopped after|has no \w+ events", text) is not None,
     "profile's step is one `torch.optim` step after a backward: a GAN's two optimizers give "
     "two steps per iteration (stopped after 1 of 3 iterations), and where the forward and "
     "backward run inside `optimizer.step(closure)` (LBFGS, Lightning's automatic "
     "optimization) a step has no optimizer-phase events"),
    ("model-used-outside-forward",
     _matches(r"mixed torch\.Tensor and DTensor|has no attribute"),
     "after FSDP2 shards the model, code that reads parameters outside the wrapped forward "
     "crashes: the VAE's `model.decode(z)` for sampling and the diffusion script's EMA "
     "(`ema_p.lerp_(p)` over `model.parameters()`)"),
    ("parameters-differ",
     _matches(r"parameters differ|diverged"),
     "the applied run trained differently from the unmodified run"),
]
OTHER = ("other", "no class above (see the cell)")
EXCLUSIVE = ("framework-fsdp-needs-a-gpu", "refused-by-design", "framework-loops",
             "plan-silently-not-applied")


def classify(rows: list[dict]) -> list[dict]:
    classes = {cid: {"id": cid, "cause": cause, "cells": [], "scripts": set(), "evidence": []}
               for cid, _predicate, cause in CLASSES + [(OTHER[0], None, OTHER[1])]}
    for row in rows:
        for name in CELLS:
            result = row[name]
            if result["verdict"] in ("works", "skipped"):
                continue
            if result["verdict"] == "refused" and not _should_work(row["truth"], name):
                continue  # a refusal of a plan the header does not claim is not a failure
            text = f"{name}: {result['detail']}"
            hits = [cid for cid, predicate, _ in CLASSES if predicate(row["truth"], name, text)]
            hits = next(([cid] for cid in hits if cid in EXCLUSIVE), hits)
            for cid in hits or [OTHER[0]]:
                entry = classes[cid]
                entry["cells"].append(f"{row['script']}/{name}")
                entry["scripts"].add(row["script"])
                if len(entry["evidence"]) < 4:
                    entry["evidence"].append(f"{row['script']}/{name} ({result['verdict']}): "
                                             f"{result['detail'][:260]}")
    ranked = [c for c in classes.values() if c["cells"]]
    ranked.sort(key=lambda c: -len(c["cells"]))
    for c in ranked:
        c["scripts"] = sorted(c["scripts"])
    return ranked


def _should_work(truth: dict, cell_name: str) -> bool:
    if cell_name == "accum":
        return "accum" in truth["plans"]
    if cell_name == "zero2":
        return "zero2" in truth["plans"]
    return True


# --- output ---------------------------------------------------------------------------------
def markdown(rows: list[dict], classes: list[dict], command: str, provenance: str) -> str:
    counts = {v: sum(row[c]["verdict"] == v for row in rows for c in CELLS)
              for v in ("works", "refused", "crashed", "wrong", "skipped")}
    total = len(rows) * len(CELLS)
    out = ["# The script zoo: memadvisor on scripts it was not written for", "",
           f"Date: {DATE}.  Machine: {MACHINE}.  memadvisor: {provenance}.", "",
           f"Command: `{command}`", "",
           "Scripts: `zoo/` (each says in its docstring which public style it imitates; its "
           "`# zoo:` header is the ground truth: batch size and layout, optimizer steps per "
           "iteration, framework, plans it ought to take).  How each cell is judged: the "
           "docstring of `benchmarks/zoo_matrix.py`.", "",
           f"**{counts['works']} of {total} cells work**; refused {counts['refused']}, crashed "
           f"{counts['crashed']}, exit 0 but wrong {counts['wrong']}, skipped {counts['skipped']}.", "",
           "| script | framework / layout | profile --steps 3 | advise --budget peak/2 | apply accum=2 | apply zero2 --nproc 2 |",
           "|---|---|---|---|---|---|"]
    for row in rows:
        truth = row["truth"]
        cells = [_cell_text(row[c]) for c in CELLS]
        out.append(f"| {row['script']} | {truth['framework']} / {truth['batch_layout']} | "
                   + " | ".join(cells) + " |")
    out += ["", "## The scripts", "", "| script | imitates the style of | batch (layout) | "
            "optimizer steps / iteration | framework |", "|---|---|---|---|---|"]
    for row in rows:
        truth = row["truth"]
        out.append(f"| `zoo/{row['script']}.py` | {imitates(row['script'])} | "
                   f"{truth['batch_size']} ({truth['batch_layout']}) | "
                   f"{truth['steps_per_iteration']} (optimizers: {truth['optimizers']}) | "
                   f"{truth['framework']} |")
    out += ["", "## Failure classes (ranked by cells broken)", "",
            "Refusals count as failures only where the script's header says the plan applies.", ""]
    for rank, c in enumerate(classes, 1):
        out.append(f"### {rank}. `{c['id']}`: {len(c['cells'])} cells, {len(c['scripts'])} scripts")
        out += ["", c["cause"] + ".", "", "Cells: " + ", ".join(c["cells"]) + ".", "", "Evidence:", ""]
        out += [f"- {e}" for e in c["evidence"]]
        out.append("")
    return "\n".join(out) + "\n"


def imitates(script_name: str) -> str:
    """The public style a zoo script says it imitates (its docstring's "Imitates the style of")."""
    path = ROOT / "zoo" / f"{script_name}.py"
    text = " ".join(path.read_text().split('"""')[1].split()) if path.exists() else ""
    found = re.search(r"Imitates the style of (.+?)(?: \(written|\.\s|\.$)", text)
    return found.group(1).replace("``", "`") if found else ""


def _cell_text(result: dict) -> str:
    detail = result["detail"].replace("|", "\\|").replace("\n", " ")
    if len(detail) > 220:
        detail = detail[:217] + "..."
    return f"**{result['verdict']}**: {detail}"


def plain_table(rows: list[dict]) -> str:
    width = max(len(r["script"]) for r in rows)
    lines = [f"{'script':<{width}}  " + "  ".join(f"{c:<8}" for c in CELLS)]
    for row in rows:
        lines.append(f"{row['script']:<{width}}  " + "  ".join(f"{row[c]['verdict']:<8}" for c in CELLS))
    return "\n".join(lines)


def provenance() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "memadvisor"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    return f"commit {head}" + (" with uncommitted changes in memadvisor/" if dirty else "")


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--reference":
        reference_main(sys.argv[2], sys.argv[3])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated script names")
    parser.add_argument("--keep", type=Path, help="keep traces and rewritten scripts here")
    parser.add_argument("--jobs", type=int, default=1, help="scripts at a time")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "ZOO.md")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--json", type=Path, help="also save the raw results here")
    parser.add_argument("--from-json", type=Path, help="render saved results, run nothing")
    parser.add_argument("--command", help="the command to record (default: this one)")
    args = parser.parse_args()

    command = args.command or "python benchmarks/zoo_matrix.py " + " ".join(sys.argv[1:])
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        rows, origin = saved["rows"], saved["provenance"]
        global DATE
        DATE = saved.get("date", DATE)
        command = args.command or saved["command"]
    else:
        scripts = zoo_scripts()
        if args.only:
            wanted = set(args.only.split(","))
            scripts = [s for s in scripts if s.name in wanted]
        root = args.keep or Path(tempfile.mkdtemp(prefix="zoo_matrix_"))
        steps_flag = apply_has_steps()
        origin = provenance() + ("" if steps_flag else "; `apply` has no `--steps` (scripts run "
                                 "their default 3 iterations)")
        try:
            with ThreadPoolExecutor(max_workers=args.jobs) as pool:
                rows = list(pool.map(lambda s: run_script(s, root, steps_flag), scripts))
        finally:
            if args.keep is None:
                shutil.rmtree(root, ignore_errors=True)
        if args.json:
            args.json.write_text(json.dumps({"rows": rows, "provenance": origin,
                                             "command": command, "date": DATE}, indent=1))
    classes = classify(rows)
    print(plain_table(rows))
    for rank, c in enumerate(classes, 1):
        print(f"{rank}. {c['id']}: {len(c['cells'])} cells ({', '.join(c['scripts'])})")
    if not args.no_write:
        args.out.write_text(markdown(rows, classes, command, origin))
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
