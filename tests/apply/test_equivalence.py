"""Every knob that runs on CPU, on every bundled example, in one process: the rewritten
script runs to the end, and its final parameters are the unmodified run's.

Tolerances (relative error of all parameters as one vector, see ``relative_error``):
math-preserving plans 1e-5 (measured: 0 for checkpointing, <2e-7 for accumulation);
amp-bf16 and bf16 1e-2 after 3 steps (measured 5e-4 to 4.5e-3).  The CNN has BatchNorm,
whose batch statistics change when the batch is split, so its split plans are held to
5e-2 (measured 9e-3 / 1.6e-2) and the distributed test checks them against their exact
single-process equivalent instead.
"""
import warnings

import pytest
import torch

from apply_runs import EXAMPLE_ARGS, EXAMPLES, relative_error, run_applied, run_original
from memadvisor.errors import UserError

MATH_PRESERVING = ["none", "checkpoint=auto", "accum=2", "accum=4", "checkpoint=auto,accum=2"]
PRECISION = ["precision=amp-bf16", "precision=bf16", "precision=amp-bf16,checkpoint=auto,accum=2"]
OPTIMIZER_SWAPS = ["optimizer=sgd", "optimizer=sgd-momentum", "optimizer=adafactor",
                   "optimizer=sgd-momentum,precision=amp-bf16,accum=2"]
EXACT, PRECISION_TOLERANCE, BATCH_NORM_SPLIT_TOLERANCE = 1e-5, 1e-2, 5e-2


def splits_batch(plan):
    return "accum=" in plan or "world=" in plan


@pytest.mark.parametrize("name", list(EXAMPLE_ARGS))
def test_math_preserving_plans_equal_the_unmodified_run(name, runs):
    errors = {}
    for plan in MATH_PRESERVING:
        params = runs.applied(name, plan, EXAMPLE_ARGS[name])
        errors[plan] = relative_error(params, runs.original(name, EXAMPLE_ARGS[name]))
    for plan, error in errors.items():
        limit = (BATCH_NORM_SPLIT_TOLERANCE if name == "cnn_classifier.py" and splits_batch(plan)
                 else EXACT)
        assert error <= limit, (plan, errors)
    assert errors["none"] == 0.0 and errors["checkpoint=auto"] == 0.0


@pytest.mark.parametrize("name, plan, expected", [
    ("cnn_classifier.py", "accum=2", True), ("cnn_classifier.py", "checkpoint=auto", False),
    ("mlp_regressor.py", "accum=2", False)])
def test_batch_norm_under_a_split_batch_is_announced(name, plan, expected, tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_applied(EXAMPLES / name, plan, ["--steps", "1", "--batch-size", "8"], tmp_path)
    messages = [str(w.message) for w in caught if "BatchNorm" in str(w.message)]
    assert bool(messages) == expected
    if expected:
        assert messages[0] == ("memadvisor: the model has BatchNorm layers and accum=2 "
                               "normalises each micro-batch separately: training is close to, "
                               "not equal to, the unmodified run")


@pytest.mark.parametrize("name", list(EXAMPLE_ARGS))
def test_precision_plans_are_close(name, runs):
    for plan in PRECISION:
        params = runs.applied(name, plan, EXAMPLE_ARGS[name])
        error = relative_error(params, runs.original(name, EXAMPLE_ARGS[name]))
        limit = BATCH_NORM_SPLIT_TOLERANCE if name == "cnn_classifier.py" and splits_batch(
            plan) else PRECISION_TOLERANCE
        assert 0 < error <= limit, (plan, error)
        # bf16 stores the parameters in bfloat16; amp keeps fp32 master weights
        expected = torch.bfloat16 if plan.startswith("precision=bf16") else torch.float32
        assert all(p.dtype == expected for p in params), plan


@pytest.mark.parametrize("name", list(EXAMPLE_ARGS))
def test_optimizer_swaps_run_and_train(name, runs):
    for plan in OPTIMIZER_SWAPS:
        params = runs.applied(name, plan, EXAMPLE_ARGS[name])
        assert all(torch.isfinite(p.float()).all() for p in params), plan
        # a different optimizer: the parameters moved, and not the way the original's did
        assert relative_error(params, runs.original(name, EXAMPLE_ARGS[name])) > 1e-4, plan


def test_swapped_optimizer_is_the_planned_class(tmp_path):
    from memadvisor.apply import runtime
    from memadvisor.apply.launch import run_script
    from apply_runs import rewrite_to

    seen = {}
    for plan, expected in [("optimizer=sgd", (torch.optim.SGD, 0.0)),
                           ("optimizer=sgd-momentum", (torch.optim.SGD, 0.9)),
                           ("optimizer=adafactor", (torch.optim.Adafactor, None)),
                           ("none", (torch.optim.Adam, None))]:
        rewritten = rewrite_to(EXAMPLES / "mlp_regressor.py", plan, tmp_path)
        run_script(rewritten, ["--steps", "1", "--log-every", "100"])
        optimizer = runtime.current_session().optimizer
        group = optimizer.param_groups[0]
        seen[plan] = (type(optimizer), group.get("momentum"))
        assert group["lr"] == 1e-3  # the script's learning rate carries over
        runtime.finish()
        assert seen[plan] == expected


def test_adam8bit_without_bitsandbytes_is_refused(tmp_path):
    try:
        import bitsandbytes  # noqa: F401
        pytest.skip("bitsandbytes is installed")
    except ImportError:
        pass
    with pytest.raises(UserError, match="optimizer=adam8bit needs bitsandbytes"):
        run_applied(EXAMPLES / "mlp_regressor.py", "optimizer=adam8bit",
                    ["--steps", "1"], tmp_path)


def test_a_batch_made_once_before_the_loop(tmp_path):
    """Overfitting one fixed batch: the loop's parts get new names, so every step splits
    the whole batch again (rebinding ``x`` would feed step 2 a quarter of it)."""
    script = tmp_path / "fixed_batch.py"
    script.write_text(
        "import torch\n"
        "torch.manual_seed(0)\n"
        "x, y = torch.randn(8, 4), torch.randn(8, 1)\n"
        "model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))\n"
        "opt = torch.optim.Adam(model.parameters(), lr=0.01)\n"
        "for step in range(4):\n"
        "    loss = torch.nn.functional.mse_loss(model(x), y)\n"
        "    opt.zero_grad()\n"
        "    loss.backward()\n"
        "    opt.step()\n")
    original = run_original(script, [])
    assert relative_error(run_applied(script, "accum=4,checkpoint=auto", [], tmp_path),
                          original) <= EXACT
