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


def _slug(plan: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in plan)
