"""``memadvisor apply`` on tiny framework scripts, run as a user runs it (a subprocess):
the plan's knobs are the framework's, the run says what the check at the first optimizer
step saw, math-preserving plans end with the unmodified run's parameters, and a plan the
framework silently ignores stops the run with a non-zero exit."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .scripts import ACCELERATE, HF_TRAINER, LIGHTNING

ROOT = Path(__file__).resolve().parents[3]
TOLERANCE = 1e-5  # relative, the whole parameter vector


def needs(package):
    return pytest.mark.skipif(importlib.util.find_spec(package) is None,
                              reason=f"{package} is not installed")


def apply(folder: Path, source: str, plan: str, name: str) -> tuple[subprocess.CompletedProcess, Path]:
    script = folder / f"{name}.py"
    script.write_text(source)
    saved = folder / f"{name}.{plan.replace(',', '_').replace('=', '-')}.pt"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "memadvisor.cli", "apply", str(script), "--plan", plan, "-q",
         "-o", str(folder / f"{name}_{len(plan)}_applied.py"), "--save-parameters", str(saved)],
        cwd=folder, capture_output=True, text=True, timeout=240, env=env)
    return done, saved


def relative_error(a: Path, b: Path) -> float:
    first, second = torch.load(a), torch.load(b)
    assert first["names"] == second["names"]
    diff = sum(float((x.double() - y.double()).pow(2).sum())
               for x, y in zip(first["tensors"], second["tensors"]))
    total = sum(float(y.double().pow(2).sum()) for y in second["tensors"])
    return (diff / total) ** 0.5


def same_training(tmp_path, source, plan, name, expected_in_check):
    reference, reference_saved = apply(tmp_path, source, "none", name)
    assert reference.returncode == 0, reference.stderr[-2000:]
    applied, saved = apply(tmp_path, source, plan, name)
    assert applied.returncode == 0, applied.stderr[-2000:]
    check = next(line for line in applied.stderr.splitlines() if "checked at the first" in line)
    for fact in expected_in_check:
        assert fact in check
    assert relative_error(saved, reference_saved) < TOLERANCE


@needs("transformers")
def test_hf_trainer_accumulation_and_checkpointing_train_the_same_model(tmp_path):
    same_training(tmp_path, HF_TRAINER, "accum=2,checkpoint=auto", "hf",
                  ["2 forward pass(es) per step", "recomputed in backward"])


@needs("lightning")
def test_lightning_accumulation_and_checkpointing_train_the_same_model(tmp_path):
    same_training(tmp_path, LIGHTNING, "accum=2,checkpoint=auto", "lit",
                  ["2 forward pass(es) per step", "recomputed in backward"])


@needs("accelerate")
def test_accelerate_accumulation_and_checkpointing_train_the_same_model(tmp_path):
    same_training(tmp_path, ACCELERATE, "accum=2,checkpoint=auto", "acc",
                  ["2 forward pass(es) per step", "recomputed in backward"])


@needs("accelerate")
def test_accelerate_on_two_ranks_splits_each_batch(tmp_path):
    same_training(tmp_path, ACCELERATE, "shard=ddp,world=2", "acc2",
                  ["DistributedDataParallel on 2 ranks"])


@needs("accelerate")
def test_accelerate_without_its_cpu_switch_distributes_on_a_machine_without_cuda(tmp_path):
    # the zoo's accelerate_loop: Accelerator() as written for GPUs; apply sets cpu= to
    # "no CUDA here" so the plan's ranks exist on this machine too
    source = ACCELERATE.replace("Accelerator(cpu=True)", "Accelerator()")
    same_training(tmp_path, source, "shard=ddp,world=2", "acc3",
                  ["DistributedDataParallel on 2 ranks"])


@needs("transformers")
def test_hf_trainer_without_use_cpu_distributes_on_a_machine_without_cuda(tmp_path):
    source = HF_TRAINER.replace("use_cpu=True, ", "")
    assert source != HF_TRAINER
    same_training(tmp_path, source, "shard=ddp,world=2", "hf2",
                  ["DistributedDataParallel on 2 ranks"])


@needs("accelerate")
def test_a_plan_the_framework_ignores_stops_the_run(tmp_path):
    # with the script's own cpu=False, accelerate on a machine without CUDA distributes
    # nothing (apply leaves a cpu= the script sets as it is)
    source = ACCELERATE.replace("Accelerator(cpu=True)", "Accelerator(cpu=False)")
    if torch.cuda.is_available():
        pytest.skip("on a CUDA machine accelerate does distribute this script")
    done, saved = apply(tmp_path, source, "shard=ddp,world=2", "ignored")
    assert done.returncode != 0 and not saved.exists()
    assert "did not take effect under accelerate: shard=ddp: the model ran as Sequential" \
        in done.stderr


@needs("lightning")
def test_lightning_under_torchrun_takes_its_devices_from_the_launcher(tmp_path):
    # Lightning's DistributedSampler reshuffles the training set (its own default for
    # training), so the samples of a step differ from the single-process run's: the check
    # line and a trained model are what is asserted, not equal parameters
    done, saved = apply(tmp_path, LIGHTNING, "shard=ddp,world=2", "lit2")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "DistributedDataParallel on 2 ranks" in done.stderr and saved.exists()


def checked(done) -> str:
    assert done.returncode == 0, done.stderr[-2000:]
    return next(line for line in done.stderr.splitlines() if "checked at the first" in line)


@needs("transformers")
def test_hf_trainer_precision_and_optimizer_are_seen_in_the_run(tmp_path):
    done, _ = apply(tmp_path, HF_TRAINER, "precision=amp-bf16,optimizer=sgd-momentum", "hfo")
    line = checked(done)
    assert "autocast torch.bfloat16 in the forward" in line and "optimizer SGD" in line


@needs("lightning")
def test_lightning_precision_is_seen_in_the_run(tmp_path):
    done, _ = apply(tmp_path, LIGHTNING, "precision=amp-bf16", "litp")
    assert "autocast torch.bfloat16 in the forward" in checked(done)
