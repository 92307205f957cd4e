"""Helpers the apply tests share: run a script unmodified or rewritten, compare parameters.

``run_original`` runs a script in this process and keeps the parameters its optimizer
holds after the last step (a global optimizer hook, so the script is not touched).
``run_applied`` rewrites it for a plan and runs it through ``memadvisor.apply.launch``.
``run_distributed`` runs several rewritten scripts in one torchrun job (``dist_jobs.py``),
which keeps the multi-process tests to a few process launches.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from memadvisor.apply import launch
from memadvisor.apply.rewrite import rewrite_source
from memadvisor.plan import Plan

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
FIXTURES = REPO / "tests" / "fixtures" / "scripts"

#: small, fast arguments for each bundled example (batch divisible by 2 ranks x 4 micro-batches)
EXAMPLE_ARGS = {
    "gpt_lm.py": ["--steps", "3", "--batch-size", "8", "--log-every", "100"],
    "cnn_classifier.py": ["--steps", "3", "--batch-size", "8", "--channels", "4",
                          "--image-size", "16", "--num-stages", "2", "--log-every", "100"],
    "mlp_regressor.py": ["--steps", "3", "--batch-size", "16", "--log-every", "100"],
}


def run_original(script: Path, args: list[str]) -> list[torch.Tensor]:
    """The unmodified script's final parameters, in its optimizer's order."""
    last = {}

    def keep(optimizer, *_):
        last["optimizer"] = optimizer

    handle = register_optimizer_step_post_hook(keep)
    try:
        launch.run_script(script, args)
    finally:
        handle.remove()
    return [p.detach().clone() for g in last["optimizer"].param_groups for p in g["params"]]


def rewrite_to(script: Path, plan: str, folder: Path) -> Path:
    """The script rewritten for ``plan``, written into ``folder`` beside a copy of its
    siblings' names (so a script importing a sibling module still finds it)."""
    rewrite = rewrite_source(script.read_text(), Plan.parse(plan), str(script))
    name = f"{script.stem}__{_slug(plan)}.py"
    target = folder / name
    target.write_text(rewrite.code)
    return target


def run_applied(script: Path, plan: str, args: list[str], folder: Path) -> list[torch.Tensor]:
    rewritten = rewrite_to(script, plan, folder)
    saved = folder / f"{rewritten.stem}.pt"
    launch.run_in_process(rewritten, args, save_parameters=saved)
    return torch.load(saved)["tensors"]


def run_distributed(jobs: list[tuple[Path, str, list[str]]], nproc: int, folder: Path,
                    timeout_s: float = 300, backend: str = "gloo") -> list[list[torch.Tensor]]:
    """Run each (script, plan, args) rewritten, in turn, inside one torchrun job."""
    specs = []
    for script, plan, args in jobs:
        rewritten = rewrite_to(script, plan, folder)
        specs.append({"script": str(rewritten), "args": args,
                      "save": str(folder / f"{rewritten.stem}.w{nproc}.pt")})
    job_file = folder / f"jobs{nproc}.json"
    job_file.write_text(json.dumps(specs))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(nproc), str(Path(__file__).with_name("dist_jobs.py")),
               str(job_file), backend]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0 and _killed_by_signal(done.stderr):
        # gloo's TCP transport has been seen to abort a rank (SIGABRT, then "connection reset"
        # in its peer) on a heavily loaded 2-core machine; a crash is not a wrong answer, so
        # run the job once more and say so -- a second crash fails the test
        warnings.warn(f"torchrun job crashed with a signal, retrying once:\n{done.stderr[-800:]}")
        done = subprocess.run(command, env=env, capture_output=True, text=True,
                              timeout=timeout_s)
    if done.returncode != 0:
        raise AssertionError(f"torchrun job failed ({done.returncode}):\n{done.stderr[-6000:]}")
    return [torch.load(spec["save"])["tensors"] for spec in specs]


def _killed_by_signal(stderr: str) -> bool:
    return "Signal 6 (SIGABRT)" in stderr or "Signal 11 (SIGSEGV)" in stderr


def relative_error(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> float:
    """||actual - expected|| / ||expected|| over all parameters as one vector.

    One vector, not tensor by tensor: some gradients are exactly zero in exact arithmetic
    (a key bias under softmax, whose scores shift uniformly), so what reaches them is
    rounding noise, and Adam normalises that noise into lr-sized steps that differ with
    the order of any sum.  Those tensors hold a few 1e-7 of the model's norm.
    """
    assert len(actual) == len(expected), (len(actual), len(expected))
    for a, e in zip(actual, expected):
        assert a.shape == e.shape, (a.shape, e.shape)
    a = torch.cat([t.detach().double().flatten() for t in actual])
    e = torch.cat([t.detach().double().flatten() for t in expected])
    return float((a - e).norm() / e.norm())


#: Float tolerance of "the same math, summed in another order".  Splitting the batch over
#: W ranks and K micro-batches turns every gradient sum into P = W x K partial sums added
#: in another order (gloo's all-reduce, accumulation into .grad), and the reference runs on
#: another thread count (MKL splits its sums by thread).  A sum of n floats reordered
#: changes by at most ~(P + log2 n) * u * sum|x| (u: the dtype's unit roundoff, eps / 2);
#: the optimizer carries the relative change of a gradient into its step (Adam's update is
#: scale-free: its relative change is the gradient's), summed over a few steps.  So the
#: relative parameter error is bounded by REORDER_FACTOR * P * eps, where REORDER_FACTOR
#: covers the steps (3-5) and the gradients' cancellation sum|x| / |sum x| (measured here:
#: at most 1.8e-7 = 0.75 P eps for P = 2, so the factor 40 leaves 50x).  It follows the dtype
#: (bf16's eps is 65,536 x fp32's) and the number of parts, not one CPU's kernels.
REORDER_FACTOR = 40


def reorder_tolerance(parts: int, dtype: torch.dtype = torch.float32) -> float:
    """Relative error allowed between two runs of the same math over ``parts`` partial
    sums of each gradient (world x accum; 1 for an unsplit run on another thread count)."""
    return REORDER_FACTOR * max(int(parts), 2) * torch.finfo(dtype).eps


def thread_spread(script: Path, args: list[str]) -> list[float]:
    """Per parameter tensor: how far the *unmodified* script's result moves when only its
    summation order changes (1 thread against 2).  A parameter whose gradient is zero in
    exact arithmetic (an attention key bias: softmax ignores a shift of its scores) gets
    rounding noise for a gradient, and Adam turns noise into lr-sized steps: its value is
    set by the order of the sums, on any machine, plan or no plan (grad_accum.py's key
    biases: 7e-3 of their norm between 1 and 2 threads, everything else below 3e-7)."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run_original(script, args)
        torch.set_num_threads(2)
        two = run_original(script, args)
    finally:
        torch.set_num_threads(threads)
    return [float((a.double() - b.double()).norm()) for a, b in zip(one, two)]


def same_math_error(actual: list[torch.Tensor], expected: list[torch.Tensor], parts: int,
                    spread: list[float] | None = None) -> float:
    """``relative_error`` over the parameters whose value the summation order does not
    decide, divided by ``reorder_tolerance`` (a pass is <= 1).  With ``spread``
    (``thread_spread`` of the reference), a tensor whose own reference moves by more than
    that tolerance when only the thread count changes is held instead to 4x that
    movement (it is noise-driven; anything the plan broke moves the other tensors too)."""
    limit = reorder_tolerance(parts, expected[0].dtype if expected else torch.float32)
    keep_actual, keep_expected, worst = [], [], 0.0
    for i, (a, e) in enumerate(zip(actual, expected)):
        own = float(e.detach().double().norm())
        if spread is not None and spread[i] > limit * max(own, 1e-12):
            worst = max(worst, float((a.double() - e.double()).norm()) / (4 * spread[i]))
            continue
        keep_actual.append(a)
        keep_expected.append(e)
    if keep_expected:
        worst = max(worst, relative_error(keep_actual, keep_expected) / limit)
    return worst


def _slug(plan: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in plan)
