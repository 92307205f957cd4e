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
BATCH_SCALED = (schema.ACTIVATION, schema.TEMPORARY, schema.OTHER)
#: slack when comparing a category with what the plan's techniques can make of it (FSDP
#: pads shards, Adam's ``step`` scalars stay fp32)
_SLACK_FRACTION, _SLACK_BYTES = 0.02, 64
#: a plan whose peak grows by less than this share of the baseline's is said to save nothing
_RAISE_FRACTION = 0.005
#: additions of a few bytes each (the scaler, a generator state): named only for a small
#: change or where nothing else of the plan adds to the category
_SMALL_CHANGE_BYTES = 64 * 1024


def _reducers(plan: Plan, category: str, micro: int, batch: int
              ) -> list[tuple[str, float, bool]]:
    """What in ``plan`` can shrink ``category`` at a given moment of the step, as (label,
    smallest factor it can leave, whether it leaves exactly that factor)."""
    out: list[tuple[str, float, bool]] = []
    group = plan.shard_group_size
    sharded = {"zero1": (schema.OPTIMIZER_STATE,),
               "zero2": (schema.OPTIMIZER_STATE, schema.GRADIENT),
               "zero3": MODEL_STATES}.get(plan.shard, ())
    if category in sharded:
        # zero1's greedy split leaves the largest share; FSDP makes a gradient's shard only
        # at its unit's reduce-scatter, so any number of them can be alive
        least = 0.0 if category == schema.GRADIENT else 1 / group
        out.append((f"{plan.shard} over {group} ranks", least, plan.shard != "zero1"
                    and category != schema.GRADIENT))
    if plan.tp > 1 and category in MODEL_STATES + (schema.ACTIVATION, schema.TEMPORARY):
        # only the split blocks' Linears (and what flows inside those blocks) shrink
        out.append((f"tp={plan.tp} splits the attention and MLP blocks", 1 / plan.tp, False))
    if plan.pp > 1 and category in MODEL_STATES + (schema.ACTIVATION, schema.TEMPORARY):
        # the layers outside the block stack stay on every stage (or the end ones)
        out.append((f"pp={plan.pp}: a stage holds its own blocks", 1 / plan.pipeline_stages,
                    False))
    if plan.precision == "bf16" and category not in (schema.INPUT, schema.AUTOCAST_WEIGHT):
        out.append(("bf16 storage", 0.5, category in MODEL_STATES + (schema.BUFFER,)))
    elif plan.precision.startswith("amp-") and category in BATCH_SCALED:
        out.append((f"{plan.precision} autocast (16-bit)", 0.5, False))
    if micro and batch and micro < batch and category in BATCH_SCALED:
        out.append((f"micro-batch {micro} of {batch}", micro / batch, False))
    if plan.checkpoint != "none" and category == schema.ACTIVATION:
        out.append(("checkpointing (freed until the recompute)", 0.0, False))
    if "activations" in plan.offload and category == schema.ACTIVATION:
        out.append(("offload activations (save_on_cpu)", 0.0, False))
    if "optimizer" in plan.offload and category in (schema.OPTIMIZER_STATE, schema.TEMPORARY):
        out.append(("optimizer state and step on the host", 0.0, False))
    if "params" in plan.offload and category in (schema.PARAMETER, schema.GRADIENT):
        out.append(("shards offloaded to the host", 0.0, False))
    if plan.optimizer != "keep" and category == schema.OPTIMIZER_STATE:
        out.append((DESCRIPTIONS[plan.optimizer], 0.0, False))
    if plan.optimizer != "keep" and category == schema.TEMPORARY:
        step = ("steps in place" if plan.optimizer.startswith("sgd")
                else "makes one step temporary")
        out.append((f"{plan.optimizer} {step}", 0.0, False))
    return out


def _adders(plan: Plan, category: str) -> tuple[list[str], list[str]]:
    """What in ``plan`` can add to ``category``: (labels, labels of additions of a few
    bytes)."""
    out, small = [], []
    fsdp = plan.shard in ("zero2", "zero3")
    if category == schema.PARAMETER and fsdp:
        out.append("units gathered for compute")
    if category == schema.GRADIENT and plan.accum > 1:
        out.append("kept and accumulated across micro-batches")
    if category == schema.OPTIMIZER_STATE and plan.optimizer != "keep":
        out.append(DESCRIPTIONS[plan.optimizer])
    if category in (schema.ACTIVATION, schema.TEMPORARY) and plan.checkpoint != "none":
        out.append("checkpoint recompute in backward")
    if category == schema.ACTIVATION and plan.pp > 1:
        out.append(f"pp={plan.pp}: the saved activations of each micro-batch in flight")
    if category == schema.AUTOCAST_WEIGHT and plan.precision.startswith("amp-"):
        out.append(f"autocast's 16-bit copies of the weights ({plan.precision})")
    if category == schema.TEMPORARY:
        if plan.tp > 1:
            out.append(f"tp={plan.tp}'s all-reduced copy of each partial sum")
        if fsdp:
            out.append("unsharded gradients until their reduce-scatter")
        if plan.optimizer in ("adafactor", "adam8bit"):
            out.append(f"{plan.optimizer} step temporaries")
    if category == schema.OTHER:
        if plan.shard in ("ddp", "zero1"):
            out.append("DDP gradient buckets")
        if fsdp:
            out.append("FSDP all-gather / reduce-scatter buffers")
        if plan.checkpoint != "none":
            small.append("checkpoint's saved RNG state")
        if plan.precision == "amp-fp16":
            small.append("fp16 gradient scaler")
    return out, small


def _foreach_step(plan: Plan, predicted: dict[str, int]) -> bool:
    """Whether the plan's peak looks like a GPU target's foreach Adam step, which makes
    every parameter's temporary at once (``simulator._device_optimizer_rules``): all
    gradients alive, no activations, temporaries as large as the parameters."""
    if plan.optimizer != "keep" or "optimizer" in plan.offload:
        return False
    parameters = predicted.get(schema.PARAMETER, 0)
    return (parameters > 0 and predicted.get(schema.TEMPORARY, 0) >= 0.9 * parameters
            and predicted.get(schema.GRADIENT, 0) >= 0.9 * parameters
            and predicted.get(schema.ACTIVATION, 0) <= 0.05 * parameters)


def _moment(plan: Plan, category: str, before: int, after: int) -> str:
    """A change no technique of the plan makes in this direction: the category is alive
    in another amount at the moment the plan peaks than at the baseline's peak."""
    amount = "none" if not after else "fewer" if after < before else "more"
    if category == schema.GRADIENT and after < before and plan != Plan():
        # every plan runs apply's loop rewrite, which moves a zero_grad found between the
        # forward and the backward in front of the forward
        return (f"{amount} alive at the plan's peak (zero_grad moved before the forward, "
                "or another moment of the step)")
    return f"{amount} alive at the plan's peak (another moment of the step)"


def _slack(value: float) -> float:
    return value * _SLACK_FRACTION + _SLACK_BYTES


def _why(plan: Plan, category: str, before: int, after: int, micro: int, batch: int,
         predicted: dict[str, int] | None = None) -> str:
    """The cause of one category's change between the baseline's peak and the plan's.

    Only the amounts at the two peaks are known, not which rows make them, so a technique
    is named only for a change in a direction it can cause, and only for as much as it
    can cause: anything beyond is the category alive in another amount at the plan's
    peak moment."""
    reducers = _reducers(plan, category, micro, batch)
    adders, small = _adders(plan, category)
    if after > before:
        if not adders and small:
            adders = small
        elif small and after - before <= _SMALL_CHANGE_BYTES:
            adders = adders + small
        if (category == schema.TEMPORARY and predicted is not None
                and _foreach_step(plan, predicted)):
            # a peak in the optimizer step: what backward adds is gone by then
            adders = ["a GPU target's foreach optimizer step (all parameters at once)"]
        return "; ".join(adders) if adders else _moment(plan, category, before, after)
    if not reducers:
        return _moment(plan, category, before, after)
    floor = ceiling = float(before)
    for _, least, exact in reducers:
        floor *= least
        ceiling *= least if exact else 1.0
    text = "; ".join(label for label, _, _ in reducers)
    if not after and floor > 0:
        return _moment(plan, category, before, after)
    if after < floor - _slack(floor):
        return f"{text}; beyond that, {_moment(plan, category, before, after)}"
    if after > ceiling + _slack(ceiling):
        if adders:
            return f"{text}; plus {'; '.join(adders)}"
        return f"{text}; but {_moment(plan, category, ceiling, after)}"
    return text


def category_terms(baseline: dict[str, int], predicted: dict[str, int], plan: Plan,
                   micro: int, batch: int) -> list[str]:
    """'optimizer state 4.2 GiB -> 0.5 GiB: zero3 over 8 ranks' for each category at the peak."""
    if not predicted:
        return []  # a prediction made without categories (``quick_simulate``)
    lines = []
    for category in schema.CATEGORIES:
        before, after = baseline.get(category, 0), predicted.get(category, 0)
        if not before and not after:
            continue
        label = LABELS.get(category, category)
        if format_bytes(before) == format_bytes(after):
            lines.append(f"{label} {format_bytes(after)}")
        else:
            lines.append(f"{label} {format_bytes(before)} -> {format_bytes(after)}: "
                         f"{_why(plan, category, before, after, micro, batch, predicted)}")
    return lines


def small_saving_reasons(baseline: dict[str, int], predicted_peak: int, baseline_peak: int,
                         plan: Plan, predicted: dict[str, int] | None = None) -> list[str]:
    """Why the plan saves little (under 20% of the baseline peak) or raises the peak: what
    it adds at its peak and which large category it does not shrink.  ``predicted``: the
    plan's bytes by category at its peak (without it, what the plan adds is told from the
    plan alone)."""
    if baseline_peak <= 0 or predicted_peak < 0:
        return []
    saved = 1 - predicted_peak / baseline_peak
    if saved >= 0.2:
        return []
    out = []
    if saved < -_RAISE_FRACTION:
        out.append(f"the plan raises the peak by {-saved:.1%} "
                   f"(+{format_bytes(predicted_peak - baseline_peak)})")
        out += (_added_terms(baseline, predicted, plan) if predicted
                else _additions(baseline, plan))
    reasons = _untouched(baseline, plan)
    if saved < 0.05 and not reasons:
        reasons = _dominant(baseline, plan)
    return out + reasons


def _added_terms(baseline: dict[str, int], predicted: dict[str, int], plan: Plan,
                 most: int = 3) -> list[str]:
    """'+146 KiB other: DDP gradient buckets' for the categories that grew most."""
    grown = sorted(((predicted.get(c, 0) - baseline.get(c, 0), c) for c in schema.CATEGORIES),
                   reverse=True)
    # only growth is explained here, and no batch split makes a category grow
    return [f"+{format_bytes(delta)} {LABELS.get(c, c)}: "
            f"{_why(plan, c, baseline.get(c, 0), predicted.get(c, 0), 0, 0, predicted)}"
            for delta, c in grown[:most] if delta > _SLACK_BYTES]


def _additions(baseline: dict[str, int], plan: Plan) -> list[str]:
    """What the plan adds, told from the plan alone: DDP's buckets are alive all step (so at
    any peak); the rest only while they are used."""
    out = []
    if plan.shard in ("ddp", "zero1"):
        gradients = baseline.get(schema.PARAMETER, 0) * (0.5 if plan.precision == "bf16" else 1)
        out.append(f"about +{format_bytes(gradients)}: DDP gradient buckets (a copy of every "
                   "gradient, alive all step)")
    others = [label for category in schema.CATEGORIES for labels in _adders(plan, category)
              for label in labels if label != "DDP gradient buckets"]
    others = list(dict.fromkeys(others))
    if others:
        out.append("it also adds " + ", ".join(others) + " while in use (the terms show "
                   "what is alive at its peak)")
    if not out:
        out.append("nothing the plan adds: more is alive at its peak, which falls at another "
                   "moment of the step")
    return out


def _shares(baseline: dict[str, int]) -> tuple[float, float, float]:
    """(total bytes, model states' share, activations' and temporaries' share)."""
    total = float(sum(baseline.values()) or 1)
    model_states = sum(baseline.get(c, 0) for c in MODEL_STATES) / total
    activations = (baseline.get(schema.ACTIVATION, 0) + baseline.get(schema.TEMPORARY, 0)) / total
    return total, model_states, activations


def _untouched(baseline: dict[str, int], plan: Plan) -> list[str]:
    """Large parts of the baseline peak a technique of the plan does not act on."""
    total, model_states, activations = _shares(baseline)
    out = []
    if plan.shard in ("zero1", "zero2", "zero3") and activations > 0.5:
        out.append(f"activations and temporaries are {activations:.0%} of the baseline peak and "
                   "ZeRO only shards model states (parameters, gradients, optimizer state)")
    if plan.shard == "ddp":
        out.append(f"DDP keeps all model states ({model_states:.0%} of the baseline peak) on "
                   "every rank and adds gradient buckets: only the per-rank batch shrinks")
    if plan.checkpoint != "none" and model_states > 0.5:
        out.append(f"model states are {model_states:.0%} of the baseline peak and "
                   "checkpointing only frees activations")
    if plan.precision.startswith("amp-") and model_states > 0.5:
        out.append(f"model states are {model_states:.0%} of the baseline peak and autocast "
                   "keeps them fp32 (only activations and temporaries become 16-bit)")
    if plan.accum > 1 and activations < 0.3:
        out.append(f"batch-dependent tensors are only {activations:.0%} of the baseline peak: "
                   "smaller micro-batches have little to shrink")
    state = baseline.get(schema.OPTIMIZER_STATE, 0) / total
    if plan.optimizer != "keep" and state < 0.2:
        out.append(f"optimizer state is only {state:.0%} of the baseline peak")
    return out


def _dominant(baseline: dict[str, int], plan: Plan) -> list[str]:
    """The largest category of the baseline peak, and why the plan leaves it as large."""
    if not baseline:
        return []
    category = max(baseline, key=lambda c: baseline[c])
    label = LABELS.get(category, category)
    share = baseline[category] / float(sum(baseline.values()) or 1)
    reducers = [name for name, _, _ in _reducers(plan, category, 0, 0)]
    split = plan.world * plan.accum > 1 and category in BATCH_SCALED
    largest = f"the largest part of the baseline peak, {label} ({share:.0%}),"
    if not reducers and not split:
        return [f"{largest} is not something the plan shrinks"]
    if category == schema.ACTIVATION and plan.checkpoint != "none":
        return [f"activations are {share:.0%} of the baseline peak, but the recompute brings "
                "a region's activations back before its backward: a region as large as the "
                "model saves nothing (checkpoint smaller modules)"]
    if split:
        return [f"{largest} hardly scales with the batch: a smaller batch per micro-step "
                "leaves it"]
    if plan.precision.startswith("amp-") and category in BATCH_SCALED:
        return [f"{largest} comes mostly from ops autocast keeps in fp32"]
    return [f"{largest} is shrunk little ({'; '.join(reducers)})"]


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
        out.append(_ranks(plan))
    if plan.offload:
        out.append("offload " + "+".join(sorted(plan.offload)) + " to host memory")
    return out or ["nothing: the unmodified script"]


def _ranks(plan: Plan) -> str:
    """'8 ranks (zero3)'; with ``tp`` or ``pp``: how the ranks split the model and the
    batch."""
    hybrid = f", hybrid groups of {plan.hybrid}" if plan.hybrid else ""
    if plan.tp < 2 and plan.pp < 2:
        return f"{plan.world} ranks ({plan.shard}{hybrid})"
    split = " within ".join(part for part in (_tensor_split(plan), _pipeline_split(plan))
                            if part)
    groups = plan.data_parallel_size
    if groups < 2:
        return f"{plan.world} ranks ({split}; every rank sees the whole batch)"
    # ddp shards nothing: its group is every data-parallel rank
    over = plan.shard_group_size if plan.shard_group_size > 1 else groups
    return (f"{plan.world} ranks: {groups} data-parallel groups ({plan.shard} over "
            f"{over} ranks), each {split}")


def _tensor_split(plan: Plan) -> str:
    if plan.tp < 2:
        return ""
    return (f"tensor parallel over {plan.tp} (attention and MLP blocks split"
            f"{', sequence parallel' if plan.sp else ''})")


def _pipeline_split(plan: Plan) -> str:
    """'pipeline parallel over 2 stages (1f1b, 8 micro-batches)'."""
    if plan.pp < 2:
        return ""
    virtual = plan.pipeline_stages_per_rank
    stages = (f"{plan.pipeline_stages} stages, {virtual} per rank" if virtual > 1
              else f"{plan.pp} stages")
    return (f"pipeline parallel over {stages} ({plan.schedule}, "
            f"{plan.pipeline_microbatches} micro-batches)")
