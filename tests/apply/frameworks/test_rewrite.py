"""The framework rewrites: which configuration lines a plan edits, and what is refused by
name before anything runs (syntax only; the installed transformers is read for its knobs)."""
import importlib.util

import pytest

from memadvisor.apply.rewrite import RewriteError, rewrite_source
from memadvisor.plan import Plan

from .scripts import ACCELERATE, HF_TRAINER, LIGHTNING

needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="transformers is not installed")


def added(source: str, plan: str) -> list[str]:
    diff = rewrite_source(source, Plan.parse(plan), "train.py").diff()
    return [line[1:].strip() for line in diff.splitlines()
            if line.startswith("+") and not line.startswith("+++")]


def refusal(source: str, plan: str) -> str:
    with pytest.raises(RewriteError) as error:
        rewrite_source(source, Plan.parse(plan), "train.py")
    return str(error.value)


@needs_transformers
def test_hf_accum_edits_training_arguments_and_keeps_the_effective_batch():
    lines = added(HF_TRAINER, "accum=2,precision=amp-bf16,checkpoint=auto,optimizer=adafactor")
    text = "\n".join(lines)
    assert 'mem.expect_plan("precision=amp-bf16,checkpoint=auto,accum=2,optimizer=adafactor"' in text
    assert "per_device_train_batch_size=mem.split_batch(8, parts=2)" in text
    assert "gradient_accumulation_steps=2" in text and "bf16=True" in text
    assert "_checkpointing=True" in text and 'optim="adafactor"' in text
    assert "mem.backward" not in text and "mem.prepare" not in text


@needs_transformers
def test_hf_ranks_split_the_per_device_batch_and_zero3_is_fsdp():
    text = "\n".join(added(HF_TRAINER, "shard=zero3,world=2"))
    assert "mem.split_batch(8, parts=2)" in text
    assert '"reshard_after_forward": True' in text and "fsdp=True" in text


@needs_transformers
@pytest.mark.parametrize("plan, knob", [
    ("checkpoint=transformer.h.0", "checkpoint=transformer.h.0"),
    ("shard=zero1,world=2", "shard=zero1"),
    ("precision=bf16", "precision=bf16"),
    ("shard=zero3,world=4,hybrid=2", "hybrid=2"),
])
def test_hf_refuses_what_training_arguments_cannot_express(plan, knob):
    message = refusal(HF_TRAINER, plan)
    assert knob in message and "train.py:" in message


def test_lightning_accum_and_ddp_edit_trainer_and_the_training_loader():
    text = "\n".join(added(LIGHTNING, "accum=2,shard=ddp,world=2,checkpoint=auto"))
    assert "batch_size=mem.split_batch(8, parts=4)" in text
    assert "accumulate_grad_batches=2" in text and 'strategy="ddp"' in text
    assert "devices=mem.ranks_per_node(2)" in text and "num_nodes=mem.nodes(2)" in text
    assert "callbacks=[mem.lightning_checkpointing()]" in text


def test_lightning_fsdp_uses_fsdp_strategy():
    text = "\n".join(added(LIGHTNING, "shard=zero2,world=2"))
    assert "from lightning.pytorch.strategies import FSDPStrategy" in text
    assert 'FSDPStrategy(sharding_strategy="SHARD_GRAD_OP"' in text


def test_lightning_refuses_an_optimizer_swap_naming_configure_optimizers():
    message = refusal(LIGHTNING, "optimizer=adafactor")
    assert "optimizer=adafactor" in message and "configure_optimizers (line" in message


def test_accelerate_accum_adds_accumulate_and_never_touches_backward():
    code = rewrite_source(ACCELERATE, Plan.parse("accum=2,precision=amp-bf16"), "t.py").code
    assert "with accelerator.accumulate(model):" in code
    assert "accelerator.backward(loss)" in code and "mem.backward" not in code
    assert "gradient_accumulation_steps=2" in code and 'mixed_precision="bf16"' in code
    assert "batch_size=mem.split_batch(8, parts=2)" in code
    # the schedule was sized in batches: it is now sized in optimizer steps
    assert "total_iters=mem.optimizer_steps(len(loader), accum=2)" in code
    compile(code, "t.py", "exec")


def test_accelerate_ranks_split_each_batch():
    text = "\n".join(added(ACCELERATE, "shard=ddp,world=2"))
    assert "dataloader_config=DataLoaderConfiguration(split_batches=True)" in text


def test_accelerate_checkpoints_the_model_it_prepares():
    text = "\n".join(added(ACCELERATE, "checkpoint=auto"))
    assert "accelerator.prepare(mem.checkpointed(model), optimizer, loader, scheduler)" in text


def test_accelerate_fsdp_checkpoints_through_its_plugin_only():
    text = "\n".join(added(ACCELERATE, "shard=zero3,world=2,checkpoint=auto"))
    assert "FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True, " \
           "activation_checkpointing=True)" in text and "mem.checkpointed" not in text
    assert "checkpoint=0" in refusal(ACCELERATE, "shard=zero3,world=2,checkpoint=0")


def test_a_rewritten_framework_script_is_not_rewritten_again():
    once = rewrite_source(LIGHTNING, Plan.parse("accum=2"), "t.py").code
    assert "already rewritten" in refusal(once, "accum=4")


@needs_transformers
@pytest.mark.parametrize("shard, reshard", [("zero2", False), ("zero3", True)])
def test_hf_fsdp_knobs_are_accepted_by_the_installed_training_arguments(tmp_path, shard,
                                                                        reshard):
    import ast

    from transformers import TrainingArguments

    from memadvisor.apply.frameworks.hf_trainer import _sharding
    knobs = _sharding(Plan.parse(f"shard={shard},world=2"), "train.py:1")
    arguments = TrainingArguments(output_dir=str(tmp_path), report_to=[],
                                  fsdp=ast.literal_eval(knobs["fsdp"]),
                                  fsdp_config=ast.literal_eval(knobs["fsdp_config"]))
    assert arguments.fsdp_plugin_args["fsdp_version"] == 2
    assert arguments.fsdp_plugin_args["reshard_after_forward"] is reshard


@pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                    reason="lightning is not installed")
def test_lightning_fsdp_strategy_builds_with_the_repeated_blocks_policy():
    import torch
    from lightning.pytorch.strategies import FSDPStrategy

    from memadvisor.apply.frameworks import repeated_blocks_policy
    policy = repeated_blocks_policy()
    strategy = FSDPStrategy(sharding_strategy="SHARD_GRAD_OP", auto_wrap_policy=policy)
    assert strategy.sharding_strategy.name == "SHARD_GRAD_OP"
    model = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]))
    wrapped = policy._run_policy(model, set(), {})  # torch's own entry point
    assert {type(m).__name__ for m in wrapped} >= {"Linear"} and len(wrapped) >= 2


def test_accelerate_data_parallel_plans_may_train_on_the_cpu():
    # cpu= as the script has it: absent -> asked at run time; an expression (accelerate's
    # own examples pass cpu=args.cpu) -> kept, or-ed with it; a literal -> the script's
    # decision, left alone; FSDP plans are not distributed by cpu=True: not set there
    plain = ACCELERATE.replace("Accelerator(cpu=True)", "Accelerator()")
    assert "accelerator = Accelerator(cpu=mem.without_cuda(), dataloader_config=" \
        "DataLoaderConfiguration(split_batches=True))" in added(plain, "shard=ddp,world=2")
    by_option = ACCELERATE.replace("Accelerator(cpu=True)", "Accelerator(cpu=args.cpu)")
    assert any("cpu=(args.cpu) or mem.without_cuda()" in line
               for line in added(by_option, "shard=ddp,world=2"))
    assert not any("without_cuda" in line for line in added(ACCELERATE, "shard=ddp,world=2"))
    assert not any("without_cuda" in line for line in added(plain, "accum=2"))
    assert not any("without_cuda" in line for line in added(plain, "shard=zero3,world=2"))


@needs_transformers
def test_hf_data_parallel_plans_may_train_on_the_cpu():
    plain = HF_TRAINER.replace("use_cpu=True, ", "")
    assert any("use_cpu=mem.without_cuda()" in line for line in added(plain, "shard=ddp,world=2"))
    assert not any("without_cuda" in line for line in added(HF_TRAINER, "shard=ddp,world=2"))
