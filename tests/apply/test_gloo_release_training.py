"""FSDP plans on 2 gloo ranks whose collectives are drained (``apply/gloo_release.py``)
train as without the drain: the final parameters are held to the same bounds as
``test_distributed.py`` holds them (the unmodified run and the single-process
equivalent), and each rank says it drained."""
import json
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from apply_runs import EXAMPLE_ARGS, EXAMPLES, REPO, rewrite_to
from test_distributed import check

PLANS = ["shard=zero2,world=2", "shard=zero3,world=2",
         "shard=zero3,world=2,accum=2,checkpoint=auto"]


def run_one_worker_jobs(jobs, nproc: int, folder: Path, timeout_s: float = 600):
    specs = []
    for script, plan, args in jobs:
        rewritten = rewrite_to(script, plan, folder)
        specs.append({"script": str(rewritten), "args": args,
                      "save": str(folder / f"{rewritten.stem}.w{nproc}.pt")})
    job_file = folder / "jobs.json"
    job_file.write_text(json.dumps(specs))
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    runner = Path(__file__).with_name("dist_jobs_one_worker.py")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", str(nproc), str(runner), str(job_file)],
                          env=env, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, done.stderr[-6000:]
    # the ranks print at once: two lines can arrive glued ("drained 489 timesdrained 489
    # times"), so each count is found by its pattern, not per line
    drained = [int(n) for n in re.findall(r"drained (\d+) times", done.stdout)]
    assert len(drained) == nproc and min(drained) > 0, done.stdout[-2000:]
    return [torch.load(spec["save"])["tensors"] for spec in specs]


@pytest.mark.slow
def test_drained_fsdp_plans_train_as_the_unmodified_run(tmp_path, runs):
    jobs = [(EXAMPLES / name, plan, args) for name, args in EXAMPLE_ARGS.items()
            for plan in PLANS]
    params = run_one_worker_jobs(jobs, 2, tmp_path)
    results = {(script.name, plan): p for (script, plan, _), p in zip(jobs, params)}
    errors = check(results, runs)
    assert len(errors) == len(jobs)


@pytest.mark.slow
def test_drained_tensor_parallel_plans_train_as_the_unmodified_run(tmp_path):
    """DTensor's functional collectives waited through the drained ``wait_tensor``: held
    as ``test_tensor_parallel.py`` holds the same plans on torch's gloo."""
    from apply_runs import relative_error, run_original, same_math_error
    from memadvisor.plan import Plan

    gpt, llama = REPO / "examples" / "gpt_lm.py", REPO / "zoo" / "llama_decoder.py"
    gpt_args = ["--steps", "3", "--batch-size", "8", "--log-every", "100"]
    jobs = [(gpt, "tp=2,world=2", gpt_args), (llama, "tp=2,world=2", []),
            (gpt, "tp=2,world=2,sp", gpt_args)]
    results = run_one_worker_jobs(jobs, 2, tmp_path)
    for (script, plan, args), params in zip(jobs, results):
        original = run_original(script, args)
        parts = Plan.parse(plan).tp * Plan.parse(plan).data_parallel_size
        error = same_math_error(params, original, parts)
        assert error <= 1, (script.name, plan, relative_error(params, original))
