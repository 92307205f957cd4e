"""Did every knob of the plan take effect?  Checked once per optimizer, just before its first
step (nothing has been updated yet), so a rewritten script never trains on to exit 0 with a
knob silently missing: a missing knob stops the run with a PlanError naming it.

=============  ============================================================================
knob           evidence gathered since ``prepare``
=============  ============================================================================
(prepare)      ``mem.step`` was given an optimizer ``prepare`` returned
precision      the prepared model's forward ran under ``torch.autocast`` of the plan's dtype
checkpoint     a checkpointed module ran with gradients and was recomputed in backward
shard          ddp/zero1: the DistributedDataParallel wrapper ran a forward; zero2/zero3:
               every parameter is a DTensor shard and the FSDP module ran a forward
accum          the backward before the step ran inside ``mem.micro_batches`` (loss weighted
               by 1/accum)
=============  ============================================================================
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..plan import Plan, PlanError


@dataclass
class Evidence:
    """What happened to one prepared model since ``prepare`` (counted by its hooks)."""
    autocast_forwards: int = 0  #: forwards of the model run under the plan's autocast
    wrapper_forwards: int = 0  #: forwards through the DDP wrapper / FSDP root
    checkpointed_forwards: int = 0  #: checkpointed module calls with gradients enabled
    checkpointed_runs: int = 0  #: runs of their forwards (first runs + recomputes)

    @property
    def recomputes(self) -> int:
        return self.checkpointed_runs - self.checkpointed_forwards


def watch_wrapper(wrapped: nn.Module, evidence: Evidence) -> None:
    def count(*_):
        evidence.wrapper_forwards += 1
    wrapped.register_forward_pre_hook(count)


def missing_knob(plan: Plan, evidence: Evidence, module: nn.Module, model_name: str,
                 weighted_backwards: int, backwards: int,
                 checkpointed: bool = True) -> str | None:
    """The first knob of ``plan`` without evidence, as a sentence (None: all took effect)."""
    if plan.precision in ("amp-fp16", "amp-bf16", "bf16") and not evidence.autocast_forwards:
        return (f"precision={plan.precision} did not take effect: {model_name}'s forward never "
                "ran under autocast before the first step (the script calls another object "
                "than the model prepare returned, or only its other methods)")
    checkpointing = plan.checkpoint != "none" and checkpointed
    if checkpointing and not evidence.checkpointed_forwards:
        return (f"checkpoint={plan.checkpoint} did not take effect: no checkpointed module of "
                f"{model_name} ran with gradients before the first step")
    if checkpointing and evidence.recomputes <= 0:
        return (f"checkpoint={plan.checkpoint} did not take effect: the checkpointed modules of "
                f"{model_name} were not recomputed in the backward before the first step")
    if plan.shard in ("ddp", "zero1") and not evidence.wrapper_forwards:
        return (f"shard={plan.shard} did not take effect: the DistributedDataParallel model "
                f"prepare returned for {model_name} was never called before the first step "
                "(the script calls the unwrapped model, whose gradients are not all-reduced)")
    if plan.uses_fsdp:
        plain = [name for name, p in module.named_parameters() if not hasattr(p, "full_tensor")]
        if plain:
            return (f"shard={plan.shard} did not take effect: parameter {plain[0]} of "
                    f"{model_name} is not sharded")
        if not evidence.wrapper_forwards:
            return (f"shard={plan.shard} did not take effect: the FSDP model {model_name} never "
                    "ran a forward before the first step")
    if plan.accum > 1 and not weighted_backwards:
        ran = "ran outside mem.micro_batches, on the whole batch" if backwards else (
            "did not go through mem.backward")
        return (f"accum={plan.accum} did not take effect: the backward before the first step "
                f"{ran}")
    return None


def check(plan: Plan, evidence: Evidence, module: nn.Module, model_name: str,
          weighted_backwards: int, backwards: int, checkpointed: bool = True) -> None:
    problem = missing_knob(plan, evidence, module, model_name, weighted_backwards, backwards,
                           checkpointed)
    if problem:
        raise PlanError(f"memadvisor stopped before the first optimizer step: {problem}")
