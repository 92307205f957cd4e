"""Why a prediction is what it is: per-category terms, what each technique did, and why a
technique saved little when it did.  Pure data in, lists of sentences out."""
from __future__ import annotations

from ..plan import Plan
from ..trace import schema
from ..units import format_bytes
from .optimizer_swap import DESCRIPTIONS

LABELS = {
    schema.PARAMETER: "parameters", schema.GRADIENT: "gradients",
    schema.OPTIMIZER_STATE: "optimizer state", schema.ACTIVATION: "activations",
    schema.AUTOCAST_WEIGHT: "autocast weight copies", schema.TEMPORARY: "temporaries",
    schema.INPUT: "inputs", schema.BUFFER: "buffers", schema.OTHER: "other",
}
MODEL_STATES = (schema.PARAMETER, schema.GRADIENT, schema.OPTIMIZER_STATE)


def _why(plan: Plan, category: str, micro: int, batch: int, after: int = 1) -> str:
    reasons = []
    if plan.shard in ("zero1", "zero2", "zero3") and category in MODEL_STATES:
        level = {"zero1": (schema.OPTIMIZER_STATE,),
                 "zero2": (schema.OPTIMIZER_STATE, schema.GRADIENT),
                 "zero3": MODEL_STATES}[plan.shard]
        if category in level:
            reasons.append(f"{plan.shard} over {plan.shard_group_size} ranks")
    if plan.shard in ("ddp", "zero1") and category == schema.OTHER:
        reasons.append("DDP gradient buckets")
    if plan.shard in ("zero2", "zero3") and category == schema.OTHER:
        reasons.append("FSDP all-gather / reduce-scatter buffers")
    if plan.shard in ("zero2", "zero3") and category == schema.PARAMETER:
        reasons.append("parameters gathered for compute")
    if plan.precision != "fp32":
        if plan.precision == "bf16":
            reasons.append("bf16 storage")
        elif category in (schema.ACTIVATION, schema.TEMPORARY, schema.AUTOCAST_WEIGHT):
            reasons.append(f"{plan.precision} autocast")
    if plan.checkpoint != "none" and category in (schema.ACTIVATION, schema.TEMPORARY):
        reasons.append("checkpointing (recompute in backward)")
    if micro and batch and micro != batch and category in (
            schema.ACTIVATION, schema.TEMPORARY):
        reasons.append(f"micro-batch {micro} of {batch}")
    if plan.optimizer != "keep" and category == schema.OPTIMIZER_STATE:
        reasons.append(DESCRIPTIONS[plan.optimizer])
    if plan.offload and category in (schema.OPTIMIZER_STATE, schema.PARAMETER,
                                     schema.GRADIENT, schema.ACTIVATION):
        reasons.append("offload " + "+".join(sorted(plan.offload)))
    if reasons:
        return "; ".join(reasons)
    # the plan did not touch this category: its peak is at another moment of the step
    return ("none alive at the plan's peak, which falls at another moment of the step"
            if not after else "the plan's peak falls at another moment of the step")


def category_terms(baseline: dict[str, int], predicted: dict[str, int], plan: Plan,
                   micro: int, batch: int) -> list[str]:
    """'optimizer state 4.2 GiB -> 0.5 GiB: zero3 over 8 ranks' for each category at the peak."""
    lines = []
    for category in schema.CATEGORIES:
        before, after = baseline.get(category, 0), predicted.get(category, 0)
        if not before and not after:
            continue
        label = LABELS.get(category, category)
        if before == after:
            lines.append(f"{label} {format_bytes(after)}")
        else:
            lines.append(f"{label} {format_bytes(before)} -> {format_bytes(after)}: "
                         f"{_why(plan, category, micro, batch, after)}")
    return lines


def small_saving_reasons(baseline: dict[str, int], predicted_peak: int, baseline_peak: int,
                         plan: Plan) -> list[str]:
    """Why the plan saves little: which category the plan cannot touch dominates."""
    if baseline_peak <= 0 or predicted_peak < 0:
        return []
    saved = 1 - predicted_peak / baseline_peak
    if saved >= 0.2:
        return []
    total = sum(baseline.values()) or 1
    model_states = sum(baseline.get(c, 0) for c in MODEL_STATES) / total
    activations = (baseline.get(schema.ACTIVATION, 0) + baseline.get(schema.TEMPORARY, 0)) / total
    out = []
    if plan.shard in ("zero1", "zero2", "zero3", "ddp") and activations > 0.5:
        out.append(f"activations and temporaries are {activations:.0%} of the baseline peak and "
                   "ZeRO only shards model states (parameters, gradients, optimizer state)")
    if plan.checkpoint != "none" and model_states > 0.5:
        out.append(f"model states are {model_states:.0%} of the baseline peak and "
                   "checkpointing only frees activations")
    if plan.accum > 1 and activations < 0.3:
        out.append(f"batch-dependent tensors are only {activations:.0%} of the baseline peak: "
                   "smaller micro-batches have little to shrink")
    if plan.optimizer != "keep" and baseline.get(schema.OPTIMIZER_STATE, 0) / total < 0.2:
        out.append("optimizer state is a small part of the peak")
    return out


def changes(plan: Plan) -> list[str]:
    """What the plan changes about training, beyond memory and speed."""
    out = []
    if plan.precision == "amp-bf16":
        out.append("matmuls and convolutions compute in bf16 (fp32 master weights kept)")
    elif plan.precision == "amp-fp16":
        out.append("matmuls compute in fp16 with dynamic loss scaling (fp32 master weights)")
    elif plan.precision == "bf16":
        out.append("TRAINING SEMANTICS: parameters, gradients and optimizer state stored in "
                   "bf16 (no fp32 master copy; small updates can round away)")
    if plan.optimizer != "keep":
        out.append(f"TRAINING SEMANTICS: optimizer replaced by {DESCRIPTIONS[plan.optimizer]}; "
                   "hyperparameters need retuning")
    if plan.accum > 1:
        out.append(f"{plan.accum} micro-batches per step (same effective batch; batch-norm "
                   "statistics see the smaller micro-batch)")
    if plan.checkpoint != "none":
        out.append("checkpointed modules run forward twice (dropout masks replayed from the "
                   "saved RNG state)")
    if plan.world > 1:
        out.append(f"{plan.world} ranks ({plan.shard}{', hybrid groups of ' + str(plan.hybrid) if plan.hybrid else ''})")
    if plan.offload:
        out.append("offload " + "+".join(sorted(plan.offload)) + " to host memory")
    return out or ["nothing: the unmodified script"]
