"""The GPU-only knobs on CUDA (skipped without one): amp-fp16, every offload mode, and the
distributed plans on nccl when two GPUs are present.  Same checks as on CPU: the final
parameters against the unmodified script run on the same device."""
import pytest
import torch

from apply_runs import EXAMPLE_ARGS, EXAMPLES, relative_error, run_distributed

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

CUDA_ARGS = {name: [*args, "--device", "cuda"] for name, args in EXAMPLE_ARGS.items()
             if name != "cnn_classifier.py"}  # BatchNorm: see test_equivalence
EXACT, PRECISION_TOLERANCE = 1e-5, 2e-2

ONE_GPU = {
    "checkpoint=auto,accum=2": EXACT,
    "offload=activations": EXACT,
    "offload=optimizer": EXACT,
    "offload=activations,checkpoint=auto,accum=2": EXACT,
    "precision=amp-fp16": PRECISION_TOLERANCE,
    "precision=amp-fp16,accum=2": PRECISION_TOLERANCE,
    "precision=amp-bf16,offload=optimizer+activations": PRECISION_TOLERANCE,
    "precision=bf16": PRECISION_TOLERANCE,
}


@pytest.mark.parametrize("name", list(CUDA_ARGS))
def test_one_gpu(name, runs):
    original = runs.original(name, CUDA_ARGS[name])
    errors = {plan: relative_error([p.cpu() for p in runs.applied(name, plan, CUDA_ARGS[name])],
                                   [p.cpu() for p in original]) for plan in ONE_GPU}
    for plan, limit in ONE_GPU.items():
        assert errors[plan] <= limit, (name, errors)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_nccl(tmp_path, runs):
    plans = {"shard=ddp,world=2": EXACT, "shard=zero3,world=2,accum=2": EXACT,
             "shard=zero2,world=2,offload=optimizer+params": EXACT,
             "shard=zero3,world=2,precision=amp-fp16,offload=optimizer+params+activations":
                 PRECISION_TOLERANCE}
    jobs = [(EXAMPLES / name, plan, args) for name, args in CUDA_ARGS.items() for plan in plans]
    results = run_distributed(jobs, 2, tmp_path, backend="nccl")
    for (script, plan, args), params in zip(jobs, results):
        error = relative_error([p.cpu() for p in params],
                               [p.cpu() for p in runs.original(script.name, args)])
        assert error <= plans[plan], (script.name, plan, error)
