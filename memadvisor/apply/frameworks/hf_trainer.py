"""A plan as Hugging Face ``Trainer`` knobs: keywords of the script's ``TrainingArguments(...)``.

==================  ==================================================================
plan                ``TrainingArguments`` keyword
==================  ==================================================================
amp-bf16 / amp-fp16 ``bf16=True`` / ``fp16=True`` (accelerate's autocast)
checkpoint=auto     ``activation_checkpointing=True`` (``gradient_checkpointing`` before 5.x)
accum=K, world=W    ``gradient_accumulation_steps=K``, ``per_device_train_batch_size`` / (K*W)
optimizer           ``optim=`` sgd / adafactor / adamw_bnb_8bit (sgd-momentum: ``optim_args``)
zero2 / zero3       ``fsdp=True``, ``fsdp_config={"reshard_after_forward": False / True}``
ddp                 torchrun's environment makes the Trainer wrap the model in DDP; on a
                    machine without CUDA only with ``use_cpu=True``: ``use_cpu=<no CUDA
                    here>`` (``source.cpu_switch``)
==================  ==================================================================

Everything else is refused here, by name, before anything runs; which keywords and
optimizer names exist is read from the installed transformers.
"""
from __future__ import annotations

from ...plan import Plan
from ..rewrite import RewriteError
from .source import (Edits, Script, cpu_switch, has_star_kwargs, keyword, literal, split_batch,
                     string)

NAME = "HF Trainer"
FRAMEWORK = "hf-trainer"
DEFAULT_PER_DEVICE_BATCH = "8"  #: TrainingArguments' own default
OPTIMIZERS = {"sgd": ("sgd", None), "sgd-momentum": ("sgd", "momentum=0.9"),
              "adafactor": ("adafactor", None), "adam8bit": ("adamw_bnb_8bit", None)}


def _is_trainer(name: str) -> bool:
    return name.startswith("transformers.") and name.endswith("Trainer")


def _is_arguments(name: str) -> bool:
    return name.startswith("transformers.") and name.endswith("TrainingArguments")


def detect(script: Script) -> bool:
    return bool(script.calls_to(_is_trainer) or script.calls_to(_is_arguments))


def installed_arguments() -> tuple[set[str], set[str]]:
    """(TrainingArguments' keywords, ``optim`` names) of the installed transformers."""
    try:
        import dataclasses

        from transformers import TrainingArguments
        from transformers.training_args import OptimizerNames
    except ImportError:
        raise RewriteError("the script uses the HF Trainer but transformers is not installed "
                           "here: pip install transformers") from None
    return ({f.name for f in dataclasses.fields(TrainingArguments)},
            {o.value for o in OptimizerNames})


def rewrite(script: Script, plan: Plan, alias: str) -> tuple[Edits, dict[str, str]]:
    where = script.filename
    call = script.the_one_call(
        _is_arguments, "the HF Trainer is configured through TrainingArguments(...)")
    line = script.line(call)
    at = f"{where}:{line}"
    if has_star_kwargs(call):
        raise RewriteError(f"{at}: TrainingArguments(**...) may already set the keywords the "
                           "plan edits; write them out as keywords")
    fields, optimizer_names = installed_arguments()
    edits = Edits()
    knobs = _knobs(plan, call, at, optimizer_names)
    if "gradient_checkpointing" in knobs and "activation_checkpointing" in fields:
        # transformers 5.x renamed it (the old name warns that it goes in v6)
        knobs["activation_checkpointing"] = knobs.pop("gradient_checkpointing")
    missing = [k for k in knobs if k not in fields]
    if missing:
        raise RewriteError(f"{at}: the installed transformers' TrainingArguments has no "
                           f"{missing[0]}= (needed for the plan {plan})")
    switch = cpu_switch(call, "use_cpu", alias)
    if (plan.world > 1 and not plan.uses_fsdp and "use_cpu" in fields
            and switch is not None and keyword(call, "no_cuda") is None):
        knobs["use_cpu"] = switch  # without CUDA the Trainer distributes only with it
    for name, code in knobs.items():
        edits.set(call, name, code)
    split_batch(edits, call, "per_device_train_batch_size", plan.accum * plan.world,
                DEFAULT_PER_DEVICE_BATCH, alias, at)
    return edits, {"configuration": f"TrainingArguments at line {line}"}


def _knobs(plan: Plan, call, at: str, optimizer_names: set[str]) -> dict[str, str]:
    knobs: dict[str, str] = {}
    if plan.precision in ("amp-bf16", "amp-fp16"):
        on, off = ("bf16", "fp16") if plan.precision == "amp-bf16" else ("fp16", "bf16")
        knobs[on] = "True"
        if keyword(call, off) is not None:  # both on is an error in TrainingArguments
            knobs[off] = "False"
    elif plan.precision == "bf16":
        raise RewriteError(f"{at}: precision=bf16 (parameters and optimizer state stored in "
                           "bfloat16) has no TrainingArguments knob (bf16=True is autocast): "
                           "use precision=amp-bf16, or load the model in bfloat16 yourself")
    if plan.checkpoint == "auto":
        knobs["gradient_checkpointing"] = "True"
    elif plan.checkpoint != "none":
        raise RewriteError(f"{at}: checkpoint={'+'.join(plan.checkpoint)}: the HF Trainer "
                           "checkpoints the whole model's layers (gradient_checkpointing=True) "
                           "and cannot choose modules: use checkpoint=auto")
    if plan.accum > 1 or plan.world > 1:
        existing = keyword(call, "gradient_accumulation_steps")
        if existing is not None and literal(existing.value) not in (1, "1"):
            raise RewriteError(f"{at}: TrainingArguments already sets gradient_accumulation_"
                               f"steps; the plan's accum={plan.accum} would replace it and change "
                               "the effective batch: remove it from the script first")
    if plan.accum > 1:
        knobs["gradient_accumulation_steps"] = str(plan.accum)
    if plan.optimizer != "keep":
        name, optim_args = OPTIMIZERS[plan.optimizer]
        if name not in optimizer_names:
            raise RewriteError(f"{at}: optimizer={plan.optimizer}: the installed transformers "
                               f"has no optim={name!r}")
        knobs["optim"] = string(name)
        if optim_args:
            knobs["optim_args"] = string(optim_args)
    knobs.update(_sharding(plan, at))
    return knobs


def _sharding(plan: Plan, at: str) -> dict[str, str]:
    if plan.shard == "zero1":
        raise RewriteError(f"{at}: shard=zero1: the HF Trainer shards optimizer state only "
                           "through DeepSpeed (not configured by memadvisor): use ddp, zero2 or "
                           "zero3")
    if plan.hybrid is not None:
        raise RewriteError(f"{at}: hybrid={plan.hybrid}: the installed transformers shards "
                           "hybrid only with FSDP1 (deprecated there); its FSDP2 config has no "
                           "hybrid group: drop hybrid")
    if "activations" in plan.offload:
        raise RewriteError(f"{at}: offload=activations has no TrainingArguments knob")
    if not plan.uses_fsdp:
        if plan.offload:
            raise RewriteError(f"{at}: offload={'+'.join(sorted(plan.offload))} needs FSDP "
                               "under the HF Trainer (shard=zero2 or zero3)")
        return {}
    config = {"reshard_after_forward": "True" if plan.shard == "zero3" else "False",
              "auto_wrap_policy": '"TRANSFORMER_BASED_WRAP"'}
    if plan.offload:
        config["cpu_offload"] = "True"
    text = ", ".join(f'"{k}": {v}' for k, v in config.items())
    return {"fsdp": "True", "fsdp_config": "{" + text + "}"}
