"""A memory plan: which techniques to apply to a training step, shared by simulate and apply.

One plan is one choice per knob.  It is read from a compact ``key=value,...`` string
(``precision=amp-bf16,checkpoint=auto,shard=zero3,world=8``) or from a JSON file holding
the same keys, and validated here so that the simulator and the runtime refuse the same
impossible combinations with the same words.  Lists (``offload``, module names for
``checkpoint``) are joined with ``+`` in the compact form and are JSON lists in a file.

Data split (the contract between ``simulate`` and ``apply``): the batch the script feeds
to one forward/backward is the *global* batch of ``B`` samples.  With ``world=W`` ranks
and ``accum=K``, rank ``r`` takes the contiguous slice ``[r*B/W, (r+1)*B/W)`` of every
batch tensor and splits it into ``K`` equal micro-batches of ``B/(W*K)`` samples, so
``B`` must be divisible by ``W*K``.  Each micro-batch's loss is scaled by ``1/K`` and the
data-parallel reduction averages over the ``W`` ranks, so the gradient is the full
batch's mean gradient and the training math is the single-process run's.

Pure Python: no torch import (the simulator imports this module).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Mapping

from .errors import UserError

PRECISIONS = ("fp32", "amp-fp16", "amp-bf16", "bf16")
SHARDS = ("none", "ddp", "zero1", "zero2", "zero3")
FSDP_SHARDS = ("zero2", "zero3")  #: realised with FSDP2 ``fully_shard``
ZERO_SHARDS = ("zero1", "zero2", "zero3")
OFFLOADS = ("optimizer", "params", "activations")
OPTIMIZERS = ("keep", "sgd", "sgd-momentum", "adafactor", "adam8bit")
KEYS = ("precision", "checkpoint", "accum", "shard", "world", "hybrid", "offload", "optimizer",
        "tp", "sp", "pp", "schedule", "microbatches", "stages_per_rank")
#: pipeline schedules (torch.distributed.pipelining's Schedule1F1B, ScheduleGPipe,
#: ScheduleInterleaved1F1B)
SCHEDULES = ("1f1b", "gpipe", "interleaved")
#: stages each rank holds under schedule=interleaved when the plan does not say
DEFAULT_STAGES_PER_RANK = 2
#: keys whose compact form may stand alone (``sp`` = ``sp=on``)
FLAGS = ("sp",)
_TRUE, _FALSE = ("on", "true", "yes", "1"), ("off", "false", "no", "0", "none")

#: a module path (``blocks.0.attn``, ``0`` for a top-level Sequential's first child) or a
#: class name: dot-joined Python identifiers or non-negative integers.  None holds the
#: compact form's separators (``,`` ``=`` ``+``), so ``checkpoint=0+2+4`` reads one way only.
_MODULE_NAME = re.compile(r"(?:[^\W\d]\w*|[0-9]+)(?:\.(?:[^\W\d]\w*|[0-9]+))*")


class PlanError(UserError, ValueError):
    """A plan that cannot be read or cannot run, explained in one line."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """One memory plan.  The defaults are the unmodified script."""

    precision: str = "fp32"
    """fp32 | amp-fp16 (autocast + gradient scaling) | amp-bf16 (autocast) |
    bf16 (parameters, gradients and optimizer state stored in bfloat16)."""
    checkpoint: str | tuple[str, ...] = "none"
    """none | auto (the model's repeated blocks, see ``auto_checkpoint_modules``) |
    module paths (``blocks.0``) or class names (``Block``) to recompute in backward."""
    accum: int = 1
    """micro-batches per optimizer step; the batch is split, the effective batch is kept."""
    shard: str = "none"
    """none | ddp | zero1 (optimizer state sharded) | zero2 (+ gradients) | zero3 (+ parameters)."""
    world: int = 1
    """number of ranks (processes, one per GPU) the plan runs on."""
    hybrid: int | None = None
    """group size G: shard inside groups of G ranks, replicate across the world/G groups."""
    offload: frozenset[str] = frozenset()
    """subset of {optimizer, params, activations} kept in host memory."""
    optimizer: str = "keep"
    """keep | sgd | sgd-momentum | adafactor | adam8bit (needs bitsandbytes)."""
    tp: int = 1
    """tensor-parallel degree T: the Linears of recognised attention and MLP blocks are split
    over T ranks that share one batch; ``world / tp`` ranks remain for data parallelism
    (consecutive ranks form one tensor-parallel group)."""
    sp: bool = False
    """sequence parallel (with tp): norms, dropout and the residual stream between the
    blocks' tensor-parallel regions are split along the sequence over the T ranks."""
    pp: int = 1
    """pipeline-parallel degree P: the repeated-block stack is cut into P contiguous stages,
    one per rank; the first stage also runs what comes before the stack (embeddings), the
    last what comes after it (final norm, head, loss)."""
    schedule: str = "1f1b"
    """pipeline schedule: 1f1b (stage s holds at most P - s micro-batches' activations) |
    gpipe (every stage holds all M) | interleaved (each rank holds V stages of P x V, rank r
    the stages r, r + P, ...: a bubble V times smaller, more micro-batches in flight)."""
    microbatches: int | None = None
    """pipeline micro-batches M per step (default P); the batch is cut into M parts that
    flow through the stages, their gradients summed with weight 1/M."""
    stages_per_rank: int | None = None
    """V, the stages (virtual stages) each rank holds under schedule=interleaved (default
    2): the block stack is cut into P x V stages."""

    def __post_init__(self):
        # normalise the forms a JSON file or a caller may use, then validate
        if isinstance(self.checkpoint, (list, tuple)):
            object.__setattr__(self, "checkpoint", tuple(str(c) for c in self.checkpoint))
        if not isinstance(self.offload, frozenset):
            object.__setattr__(self, "offload", frozenset(_as_list(self.offload, "offload")))
        for problem in _static_problems(self):
            raise PlanError(problem)

    # --- reading and writing ----------------------------------------------------------
    @classmethod
    def parse(cls, text: str) -> "Plan":
        """A compact ``key=value,...`` string, ``none``, or the path of a JSON file (the
        command line's ``--plan``; anything a remote client sends goes to ``parse_spec``)."""
        text = text.strip()
        if text.endswith(".json") or (os.path.isfile(text) and not "=" in text):
            return cls.from_json_file(text)
        return cls.parse_spec(text)

    @classmethod
    def parse_spec(cls, text: str) -> "Plan":
        """A compact ``key=value,...`` string or ``none`` -- never a file: a spec from a web
        page must not make the server open a path the client names."""
        text = str(text).strip()
        if text in ("", "none", "default"):
            return cls()
        values: dict[str, str] = {}
        for item in text.split(","):
            item = item.strip()
            if not item:
                continue
            key, sep, value = item.partition("=")
            key = key.strip()
            if not sep and key in FLAGS:
                sep, value = "=", "on"
            if not sep:
                raise PlanError(f"plan item {item!r} is not key=value (keys: {', '.join(KEYS)})")
            if key in values:
                raise PlanError(f"plan sets {key!r} twice")
            values[key] = value.strip()
        return cls.from_dict(values)

    @classmethod
    def from_json_file(cls, path: str) -> "Plan":
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            raise PlanError(f"plan file {path} does not exist") from None
        except UnicodeDecodeError as exc:
            raise PlanError(f"cannot read plan file {path}: not UTF-8 text (at byte "
                            f"{exc.start}); a plan file is JSON") from None
        except (OSError, ValueError) as exc:  # ValueError: JSONDecodeError, a NUL in the path
            raise PlanError(f"cannot read plan file {path}: {exc}") from None
        except RecursionError:
            raise PlanError(f"cannot read plan file {path}: JSON nested too deep") from None
        if not isinstance(data, dict):
            raise PlanError(f"plan file {path} must hold a JSON object of {', '.join(KEYS)}")
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Plan":
        unknown = [k for k in data if k not in KEYS]
        if unknown:
            raise PlanError(f"unknown plan key {unknown[0]!r} (keys: {', '.join(KEYS)})")
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            if key in ("accum", "world", "tp", "pp"):
                kwargs[key] = _as_int(value, key, minimum=1)
            elif key in ("microbatches", "stages_per_rank"):
                kwargs[key] = None if value in (None, "", "none") else _as_int(value, key, 1)
            elif key in FLAGS:
                kwargs[key] = _as_flag(value, key)
            elif key == "hybrid":
                kwargs[key] = None if value in (None, "", "none") else _as_int(value, key, 1)
            elif key == "checkpoint":
                names = _as_list(value, key)
                kwargs[key] = names[0] if names in (["none"], ["auto"]) else tuple(names)
                if not names:
                    kwargs[key] = "none"
            elif key == "offload":
                kwargs[key] = frozenset(n for n in _as_list(value, key) if n != "none")
            else:
                kwargs[key] = str(value).strip()
        if "world" not in kwargs and (kwargs.get("tp", 1) > 1 or kwargs.get("pp", 1) > 1) \
                and kwargs.get("shard", "none") in ("none", ""):
            # tp=2 or pp=2 alone means its ranks and no more: world = tp x pp (a pipeline
            # or a tensor-parallel group with data parallelism names its world)
            kwargs["world"] = kwargs.get("tp", 1) * kwargs.get("pp", 1)
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["checkpoint"] = (list(self.checkpoint) if isinstance(self.checkpoint, tuple)
                              else self.checkpoint)
        data["offload"] = [o for o in OFFLOADS if o in self.offload]
        return data

    def to_compact(self) -> str:
        """The canonical compact form: only what differs from the defaults, in KEYS order."""
        default = Plan()
        items = []
        for key in KEYS:
            value = getattr(self, key)
            if value == getattr(default, key):
                continue
            if key == "checkpoint" and isinstance(value, tuple):
                value = "+".join(value)
            elif key == "offload":
                value = "+".join(o for o in OFFLOADS if o in value)
            elif key in FLAGS:
                items.append(key)
                continue
            items.append(f"{key}={value}")
        return ",".join(items) or "none"

    def __str__(self) -> str:
        return self.to_compact()

    # --- what the plan implies ----------------------------------------------------------
    @property
    def uses_fsdp(self) -> bool:
        return self.shard in FSDP_SHARDS

    @property
    def data_parallel_size(self) -> int:
        """Ranks that take different slices of the batch: ``world / (tp x pp)`` (the ranks
        of one tensor-parallel group, and the stages of one pipeline, share theirs)."""
        model_ranks = self.tp * self.pp if self.tp >= 1 and self.pp >= 1 else 1
        return self.world // model_ranks if self.world % model_ranks == 0 else 1

    @property
    def pipeline_microbatches(self) -> int:
        """M: micro-batches one pipeline step cuts the batch into (1 without ``pp``)."""
        if self.pp <= 1:
            return 1
        return self.microbatches or self.pp

    @property
    def pipeline_stages_per_rank(self) -> int:
        """V: pipeline stages each rank holds (1 unless ``schedule=interleaved``)."""
        if self.pp <= 1 or self.schedule != "interleaved":
            return 1
        return self.stages_per_rank or DEFAULT_STAGES_PER_RANK

    @property
    def pipeline_stages(self) -> int:
        """P x V: the stages the block stack is cut into (1 without ``pp``)."""
        return self.pp * self.pipeline_stages_per_rank if self.pp > 1 else 1

    @property
    def shard_group_size(self) -> int:
        """Ranks that share one copy of the sharded state (the data-parallel ranks unless
        hybrid)."""
        if self.shard not in ZERO_SHARDS:
            return 1
        return self.hybrid or self.data_parallel_size

    @property
    def needs_gpu(self) -> bool:
        return self.precision == "amp-fp16" or bool(self.offload)

    def micro_batch_size(self, batch_size: int) -> int:
        """Samples in one micro-batch on one rank: ``B / (world / tp * accum)``, or
        PlanError (the ranks of one tensor-parallel group take the same samples)."""
        ranks = self.data_parallel_size
        parts = ranks * self.accum * self.pipeline_microbatches
        if batch_size % parts or batch_size < parts:
            how = " x ".join(p for p in (
                (f"{ranks} data-parallel ranks" if self.tp > 1 else f"{ranks} ranks")
                if ranks > 1 else "",
                f"{self.accum} micro-batches" if self.accum > 1 else "",
                f"{self.pipeline_microbatches} pipeline micro-batches" if self.pp > 1 else "")
                if p)
            raise PlanError(
                f"a batch of {batch_size} samples cannot be split evenly into {how}: "
                f"the batch must be a multiple of {parts} (with a DataLoader, drop_last=True "
                "avoids a short last batch)")
        return batch_size // parts


def _as_int(value: Any, key: str, minimum: int) -> int:
    try:
        number = int(str(value).strip())
    except ValueError:
        raise PlanError(f"plan key {key} must be a whole number, got {value!r}") from None
    if number < minimum:
        raise PlanError(f"plan key {key} must be at least {minimum}, got {number}")
    return number


def _as_list(value: Any, key: str) -> list[str]:
    if isinstance(value, str):
        return [v.strip() for v in value.split("+") if v.strip()]
    if isinstance(value, Iterable):
        return [str(v).strip() for v in value if str(v).strip()]
    raise PlanError(f"plan key {key} must be a string or a list, got {value!r}")


def _as_flag(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise PlanError(f"plan key {key} is on or off (write {key} or {key}=off), got {value!r}")


def _choices(key: str, value: Any, allowed: tuple[str, ...]) -> str | None:
    if value not in allowed:
        return f"plan key {key} must be one of {', '.join(allowed)}; got {value!r}"
    return None


def _static_problems(plan: Plan) -> Iterable[str]:
    """Why a plan cannot run anywhere, first reason first."""
    for key, allowed in (("precision", PRECISIONS), ("shard", SHARDS), ("optimizer", OPTIMIZERS)):
        problem = _choices(key, getattr(plan, key), allowed)
        if problem:
            yield problem
    if isinstance(plan.checkpoint, str):
        if plan.checkpoint not in ("none", "auto"):
            yield f"plan key checkpoint must be none, auto or module names; got {plan.checkpoint!r}"
    else:
        if not plan.checkpoint:
            yield "plan key checkpoint lists no module names"
        for name in plan.checkpoint:
            if name in ("none", "auto") or not _MODULE_NAME.fullmatch(name):
                yield (f"checkpoint entry {name!r} is not a module path (blocks.0) or a class "
                       "name (Block); none and auto cannot be combined with names")
    for name in sorted(plan.offload):
        if name not in OFFLOADS:
            yield f"offload entry {name!r} is not one of {', '.join(OFFLOADS)} (join them with +)"
    for key in ("accum", "world", "tp", "pp"):
        if not isinstance(getattr(plan, key), int) or getattr(plan, key) < 1:
            yield f"plan key {key} must be a whole number of at least 1"
    if not isinstance(plan.sp, bool):
        yield "plan key sp is on or off"
    yield from _tensor_parallel_problems(plan)
    pipeline = list(_pipeline_problems(plan))
    yield from pipeline
    if pipeline:
        return

    world, shard = plan.data_parallel_size, plan.shard
    if shard == "none" and world > 1:
        if plan.tp > 1:
            yield (f"world={plan.world} with tp={plan.tp} leaves {world} data-parallel groups: "
                   "add shard=zero2 or zero3 (or set world equal to tp)")
        else:
            yield (f"world={world} needs a data-parallel mode: add shard=ddp, zero1, zero2 or "
                   "zero3")
    if shard != "none" and world == 1 and plan.tp > 1 and plan.world > 1:
        yield (f"shard={shard} with world={plan.world} and tp={plan.tp} has no data-parallel "
               f"rank to shard with (all {plan.world} ranks split the layers): make world a "
               f"larger multiple of tp, or use shard=none")
    elif shard != "none" and world == 1:
        what = {"ddp": "replicate", "zero1": "shard the optimizer state",
                "zero2": "shard gradients and optimizer state",
                "zero3": "shard parameters, gradients and optimizer state"}[shard]
        yield (f"shard={shard} with world=1 has no other rank to {what} with: "
               "set world to the number of GPUs, or use shard=none")
    if plan.hybrid is not None:
        group = plan.hybrid
        # under pp the groups split each stage's D = world / (pp x tp) replicas
        replicas = (f"world={world}" if plan.pp <= 1 else
                    f"the {world} data-parallel replicas of each stage (world={plan.world} / "
                    f"pp={plan.pp})")
        larger = ("world larger than the group" if plan.pp <= 1 else
                  "more data-parallel replicas per stage than the group")
        if shard not in ZERO_SHARDS:
            yield f"hybrid={group} shards inside groups: it needs shard=zero1, zero2 or zero3"
        elif group == 1:
            yield "hybrid=1 shards over groups of one rank, which is plain replication: use shard=ddp"
        elif group >= world:
            yield (f"hybrid={group} needs {larger}: with {replicas} it is plain {shard}, "
                   "drop hybrid")
        elif world % group:
            yield f"hybrid={group} must divide {replicas} into equal groups"

    offload = plan.offload
    if "params" in offload and shard not in FSDP_SHARDS:
        yield ("offload=params is realised by FSDP2's CPUOffloadPolicy: it needs shard=zero2 "
               "or zero3 (world of at least 2)")
    elif "params" in offload and "optimizer" not in offload:
        yield ("offload=params also moves gradients and the optimizer step to the host "
               "(FSDP2's CPUOffloadPolicy): write offload=optimizer+params")
    if "optimizer" in offload and "params" not in offload and shard in FSDP_SHARDS:
        yield (f"with shard={shard}, FSDP2 offloads optimizer state only together with the "
               "parameter shards: write offload=optimizer+params")
    if "optimizer" in offload and shard == "zero1":
        yield ("offload=optimizer with shard=zero1 is not supported: ZeroRedundancyOptimizer "
               "steps on the GPU; use zero2 or zero3 with offload=optimizer+params")

    if plan.optimizer == "adafactor" and shard in FSDP_SHARDS:
        yield (f"optimizer=adafactor with shard={shard}: torch.optim.Adafactor does not run on "
               "FSDP2's DTensor shards (its factored statistics use in-place ops DTensor "
               "refuses); use zero1 or another optimizer")
    if plan.optimizer == "adam8bit" and shard in FSDP_SHARDS:
        yield (f"optimizer=adam8bit with shard={shard}: bitsandbytes' 8-bit optimizers do not "
               "support FSDP2's DTensor parameters; use zero1 or another optimizer")


def _tensor_parallel_problems(plan: Plan) -> Iterable[str]:
    """Why a tp/sp plan cannot run (first increment: tp alone, or FSDP over world/tp)."""
    tp, world = plan.tp, plan.world
    if plan.sp and tp < 2:
        yield ("sp (sequence parallel) splits the sequence over the tensor-parallel ranks: it "
               "needs tp=2 or more")
    if not isinstance(tp, int) or tp < 2:
        return
    model_ranks = tp * plan.pp if isinstance(plan.pp, int) and plan.pp > 1 else tp
    if world % model_ranks:
        within = f"tp x pp = {model_ranks}" if model_ranks != tp else f"tp={tp}"
        yield (f"{within} must divide world={world}: each tensor-parallel group holds tp ranks "
               f"(world={model_ranks} for model parallelism alone)")
        return
    if plan.shard == "zero1" or (plan.shard == "ddp" and plan.pp <= 1):
        # a pipeline averages its stages' gradients itself (pipeline_data_parallel), no DDP
        yield (f"tp={tp} with shard={plan.shard} is not supported: DistributedDataParallel does "
               "not take DTensor parameters; use shard=zero2 or zero3 (FSDP over world/tp ranks)")
    if plan.hybrid is not None:
        yield f"tp={tp} with hybrid={plan.hybrid} is not supported yet"
    if plan.offload:
        yield f"tp={tp} with offload is not supported yet"
    if plan.optimizer in ("adafactor", "adam8bit"):
        yield (f"optimizer={plan.optimizer} with tp={tp}: it does not run on the DTensor "
               "parameters tensor parallelism makes; use keep, sgd or sgd-momentum")


def _pipeline_problems(plan: Plan) -> Iterable[str]:
    """Why a pp plan cannot run (a pipeline alone, world = pp, or world / pp of them side
    by side with shard=ddp)."""
    pp, schedule, microbatches = plan.pp, plan.schedule, plan.microbatches
    virtual = plan.stages_per_rank
    if schedule not in SCHEDULES:
        yield f"plan key schedule must be one of {', '.join(SCHEDULES)}; got {schedule!r}"
        return
    for key, value in (("microbatches", microbatches), ("stages_per_rank", virtual)):
        if value is not None and (not isinstance(value, int) or value < 1):
            yield f"plan key {key} must be a whole number of at least 1"
            return
    if not isinstance(pp, int) or pp < 2:
        if schedule != "1f1b" or microbatches is not None or virtual is not None:
            yield ("schedule, microbatches and stages_per_rank are pipeline-parallel settings: "
                   "add pp=2 or more (for micro-batches without a pipeline, use accum)")
        return
    if virtual is not None and schedule != "interleaved":
        yield (f"stages_per_rank={virtual} needs schedule=interleaved (1f1b and gpipe hold one "
               "stage per rank)")
    if schedule == "interleaved":
        if virtual is not None and virtual < 2:
            yield ("schedule=interleaved with stages_per_rank=1 is schedule=1f1b: give "
                   "stages_per_rank=2 or more")
        m = plan.pipeline_microbatches
        rounds = max(1, m // pp)
        if m % rounds:
            # torch 2.13's ScheduleInterleaved1F1B runs rounds of M // rounds micro-batches
            yield (f"schedule=interleaved with pp={pp} runs max(1, M // P) = {rounds} rounds "
                   f"of micro-batches, which must divide microbatches={m}: use a multiple of "
                   f"{pp} or fewer than {2 * pp}")
    model_ranks = pp * max(plan.tp, 1)  # one pipeline: P stages of tp ranks each
    alone = f"pp x tp = {model_ranks}" if plan.tp > 1 else f"pp={pp}"
    if plan.shard not in ("none", "ddp", "zero1", "zero2", "zero3"):
        yield (f"pp={pp} with shard={plan.shard} is "
               f"not supported yet: a pipeline runs alone (world={pp}) or beside copies of "
               f"itself with shard=ddp|zero1|zero2|zero3 (world = pp x replicas; the replicas "
               f"of a stage are its data-parallel group)")
    elif plan.shard != "none" and (plan.world % model_ranks or plan.world == model_ranks):
        yield (f"pp={pp} with shard={plan.shard} runs world / ({alone}) pipelines side by side: "
               f"world must be a multiple of {model_ranks} with at least 2 of them "
               f"(world={2 * model_ranks}), got world={plan.world}")
    elif plan.uses_fsdp and schedule == "interleaved":
        yield (f"pp={pp} with shard={plan.shard} and schedule=interleaved is not supported yet "
               "(FSDP's hooks would run on the blocks a rank's other stage passes through): "
               "use 1f1b or gpipe, or shard=ddp")
    elif plan.shard == "none" and plan.world != model_ranks:
        yield (f"pp={pp} with world={plan.world}: a pipeline alone runs one stage per rank"
               f"{' (per tensor-parallel rank)' if plan.tp > 1 else ''}, so world must equal "
               f"{alone} (several pipelines side by side: shard=ddp)")
    if plan.accum > 1:
        yield (f"pp={pp} cuts the batch into pipeline micro-batches itself: write "
               f"microbatches={plan.accum * plan.pipeline_microbatches} instead of accum="
               f"{plan.accum}")
    if plan.offload:
        yield f"pp={pp} with offload is not supported yet"
    if schedule == "1f1b" and plan.pipeline_microbatches < pp:
        yield (f"schedule=1f1b with pp={pp} needs at least {pp} micro-batches (one in flight "
               f"per stage), got microbatches={plan.pipeline_microbatches}: raise it, or use "
               "schedule=gpipe")


@dataclass(frozen=True, kw_only=True, slots=True)
class Environment:
    """What the machine that will run a plan offers (filled in by the runtime or the CLI)."""

    device_type: str = "cpu"  #: where the model's parameters live: 'cpu', 'cuda', ...
    bf16_supported: bool = True  #: torch.cuda.is_bf16_supported() on CUDA; True on CPU
    fp16_supported: bool = False  #: float16 autocast with gradient scaling (CUDA)
    bitsandbytes_available: bool = False


def environment_problems(plan: Plan, env: Environment) -> list[str]:
    """Why ``plan`` cannot run on ``env`` (empty when it can)."""
    problems = []
    on_gpu = env.device_type == "cuda"
    if plan.precision == "amp-fp16" and not (on_gpu and env.fp16_supported):
        problems.append(
            f"precision=amp-fp16 needs a CUDA GPU (float16 autocast with gradient scaling); "
            f"the model is on {env.device_type}: use amp-bf16 there")
    if plan.precision in ("amp-bf16", "bf16") and not env.bf16_supported:
        problems.append(f"precision={plan.precision}: this {env.device_type} device has no "
                        "bfloat16 support; use amp-fp16")
    if plan.offload and not on_gpu:
        problems.append(
            f"offload={'+'.join(sorted(plan.offload))} moves GPU memory to the host, but the "
            f"model is on {env.device_type}: there is no GPU to offload from")
    if plan.optimizer == "adam8bit" and not env.bitsandbytes_available:
        problems.append("optimizer=adam8bit needs bitsandbytes: pip install bitsandbytes")
    return problems


# --- which modules a plan touches (shared so simulate predicts what apply does) -------------
@dataclass(frozen=True, slots=True)
class ModuleEntry:
    path: str  #: 'blocks.3' ('' is the root)
    type: str  #: class name
    total_parameter_count: int  #: including children
    root: bool = False  #: a model the script calls itself ('' and further roots)


def module_entries(modules: Iterable[Any]) -> list[ModuleEntry]:
    """Accepts ModuleEntry, the trace's ModuleInfo (or its dict), or (path, type, count)."""
    entries = []
    for m in modules:
        if isinstance(m, ModuleEntry):
            entries.append(m)
        elif isinstance(m, Mapping):
            count = m.get("total_parameter_count", m.get("total_parameter_bytes", 0))
            entries.append(ModuleEntry(m["path"], m["type"], int(count), bool(m.get("root"))))
        elif isinstance(m, tuple):
            entries.append(ModuleEntry(*m))
        else:
            count = getattr(m, "total_parameter_count", getattr(m, "total_parameter_bytes", 0))
            entries.append(ModuleEntry(m.path, m.type, int(count), bool(getattr(m, "root", 0))))
    return entries


def repeated_blocks(modules: Iterable[Any]) -> list[str]:
    """The model's repeated blocks: the largest group of same-class siblings in a container.

    A group is the children of one ModuleList/Sequential (children named 0, 1, ...) that
    share a class and have parameters; the group holding the most parameters wins (ties:
    the shallowest, then the first).  These are FSDP's sharding units for zero2/zero3.
    """
    entries = module_entries(modules)
    groups: dict[tuple[str, str], list[ModuleEntry]] = {}
    for m in entries:
        parent, _, leaf = m.path.rpartition(".")
        if m.path and leaf.isdigit() and m.total_parameter_count > 0:
            groups.setdefault((parent, m.type), []).append(m)
    best: tuple | None = None
    for order, ((parent, _), members) in enumerate(groups.items()):
        if len(members) < 2:
            continue
        key = (sum(m.total_parameter_count for m in members),
               -(parent.count(".") + bool(parent)), -order)
        if best is None or key > best[0]:
            best = (key, [m.path for m in members])
    return best[1] if best else []


#: child names that make a module an attention or an MLP block for ``tp`` (shared by apply,
#: which splits them, and simulate, which predicts the split); first match per role wins
TP_QUERY = ("q_proj", "wq", "query", "q", "to_q", "q_lin", "q_linear")
TP_KEY = ("k_proj", "wk", "key", "k", "to_k", "k_lin", "k_linear")
TP_VALUE = ("v_proj", "wv", "value", "v", "to_v", "v_lin", "v_linear")
TP_ATTENTION_OUT = ("o_proj", "wo", "out_proj", "c_proj", "proj", "dense", "o", "out_lin",
                    "out", "to_out", "o_linear")
TP_FUSED_QKV = ("qkv", "c_attn", "Wqkv", "qkv_proj", "query_key_value", "in_proj", "to_qkv")
TP_MLP_UP = ("fc", "fc1", "c_fc", "w1", "w3", "up_proj", "gate_proj", "dense_h_to_4h", "lin1",
             "up", "gate", "wi", "wi_0", "wi_1")
TP_MLP_DOWN = ("proj", "fc2", "c_proj", "w2", "down_proj", "dense_4h_to_h", "lin2", "down",
               "wo")


@dataclass
class TensorParallelBlocks:
    """What ``tp`` splits: block path -> {"up": column-parallel Linear names, "down": the
    row-parallel one}, and attention blocks kept whole with the reason."""
    attention: dict[str, dict[str, list[str]]]
    mlp: dict[str, dict[str, list[str]]]
    kept: dict[str, str]

    def linear_styles(self) -> dict[str, str]:
        """Every split Linear's path -> 'colwise' | 'rowwise'."""
        out = {}
        for blocks in (self.attention, self.mlp):
            for path, roles in blocks.items():
                for role, names in roles.items():
                    for name in names:
                        out[f"{path}.{name}" if path else name] = (
                            "rowwise" if role == "down" else "colwise")
        return out


def tensor_parallel_blocks(modules: Iterable[Any]) -> TensorParallelBlocks:
    """The attention and MLP blocks ``tp`` splits, from the module tree (paths and class
    names; a child counts as a Linear when its class is ``Linear``): attention = q, k, v
    and an output Linear among the module's children; MLP = up (and gate) Linears and one
    down Linear.  A fused qkv Linear keeps its attention whole (the forward splits its
    output at fixed widths, which a column split would not follow)."""
    children: dict[str, dict[str, str]] = {}
    for m in module_entries(modules):
        if m.path:
            parent, _, leaf = m.path.rpartition(".")
            children.setdefault(parent, {})[leaf] = m.type
    attention, mlp, kept = {}, {}, {}
    for path, kids in children.items():
        linears = {name for name, kind in kids.items() if kind == "Linear"}
        q, k, v, out = ([n for n in names if n in linears] for names in (
            TP_QUERY, TP_KEY, TP_VALUE, TP_ATTENTION_OUT))
        if q and k and v and out:
            attention[path] = {"up": [q[0], k[0], v[0]], "down": [out[0]]}
            continue
        fused = [n for n in TP_FUSED_QKV if n in linears]
        if fused:
            kept[path] = (f"fused {fused[0]} Linear (q, k and v in one output, split by the "
                          "forward at fixed widths): a column split would not follow heads, "
                          "so this attention stays replicated")
            continue
        up = [n for n in TP_MLP_UP if n in linears]
        down = [n for n in TP_MLP_DOWN if n in linears and n not in up]
        if up and len(down) == 1:
            mlp[path] = {"up": up, "down": down}
    return TensorParallelBlocks(attention, mlp, kept)


@dataclass
class TensorParallelVocabulary:
    """The token embedding and the LM head ``tp`` splits along the vocabulary (torchtitan's
    ``tok_embeddings`` RowwiseParallel, ``output`` ColwiseParallel): paths, or None."""
    embedding: str | None
    head: str | None
    tied: bool  #: one weight serves both (GPT's ``lm_head.weight = tok_emb.weight``)
    #: a vocabulary embedding found with no head Linear: kept whole (its weight may be
    #: used directly, ``x @ wte.weight.T``, which a sharded weight would break)
    unpaired: str | None = None


def tensor_parallel_vocabulary(modules: Iterable[Any],
                               blocks: TensorParallelBlocks) -> TensorParallelVocabulary:
    """The vocabulary embedding -- the Embedding with the most parameters (V x D) outside
    the split blocks -- and the head: the last Linear outside them whose parameters are the
    same V x D (plus V for a bias), the vocabulary-sized output at the model's end.  From
    parameter counts alone, so the trace's module tree (simulate) and the live model (apply,
    which then checks the shapes) find the same pair.  Tied: the model's total counts the
    shared weight once, one head-sized weight less than its children's totals."""
    entries = module_entries(modules)
    regions = list(blocks.attention) + list(blocks.mlp) + list(blocks.kept)

    def outside(path: str) -> bool:
        return not any(path == r or path.startswith(r + ".") for r in regions if r)

    embeddings = [m for m in entries if m.type == "Embedding" and m.total_parameter_count > 0
                  and outside(m.path)]
    if not embeddings:
        return TensorParallelVocabulary(None, None, False)
    embedding = max(embeddings, key=lambda m: m.total_parameter_count)
    size = embedding.total_parameter_count

    def vocabulary_sized(count: int) -> bool:  # V x D, or V x D + V (a bias of V)
        return count == size or (size < count < 2 * size and size % (count - size) == 0)

    heads = [m for m in entries if m.type == "Linear" and outside(m.path)
             and vocabulary_sized(m.total_parameter_count)]
    if not heads:
        return TensorParallelVocabulary(None, None, False, unpaired=embedding.path)
    head = heads[-1]
    root = next((m for m in entries if m.path == ""), None)
    tied = False
    if root is not None:
        top = sum(m.total_parameter_count for m in entries if m.path and "." not in m.path)
        tied = top - root.total_parameter_count >= head.total_parameter_count
    return TensorParallelVocabulary(embedding.path, head.path, tied)


def auto_checkpoint_modules(modules: Iterable[Any]) -> list[str]:
    """What ``checkpoint=auto`` recomputes: every stack of repeated blocks, not only the
    largest (``repeated_blocks``, FSDP's units): a ResNet's layer1..layer4, a two-tower
    model's towers, an encoder-decoder's two stacks.  Which stack holds the activations is
    not in the module tree -- a ResNet's first stage has the fewest parameters and the
    largest activations -- and checkpointing a stack whose blocks save little costs only
    its recompute, so each one is taken.  When the repeated units are single layers
    (``Sequential(Linear, ReLU, Linear, ...)``, where wrapping one Linear saves nothing)
    and no stack of composite blocks exists, each group's container is a segment ('' =
    the whole model): a UNet's five ``double_conv`` Sequentials, not one (the zoo's
    unet_groupnorm: -35%).  Blocks inside a chosen one are left out (recomputed with
    it)."""
    entries = module_entries(modules)
    groups = _repeated_block_groups(entries)
    if not groups:
        return []
    paths = [m.path for m in entries]

    def is_leaf(block: str) -> bool:
        return not any(p.startswith(block + ".") for p in paths)

    composite = [group for group in groups if not all(is_leaf(b) for b in group)]
    if composite:
        chosen = [b for group in composite for b in group]
    else:
        chosen = list(dict.fromkeys(group[0].rpartition(".")[0] for group in groups))
    return [p for p in chosen
            if not any(q != p and (q == "" or p.startswith(q + ".")) for q in chosen)]


def _repeated_block_groups(entries: list[ModuleEntry]) -> list[list[str]]:
    """Every group ``repeated_blocks`` weighs (same-class children, named 0, 1, ..., of one
    container, with parameters, at least two), in module order."""
    groups: dict[tuple[str, str], list[str]] = {}
    for m in entries:
        parent, _, leaf = m.path.rpartition(".")
        if m.path and leaf.isdigit() and m.total_parameter_count > 0:
            groups.setdefault((parent, m.type), []).append(m.path)
    return [members for members in groups.values() if len(members) >= 2]


def resolve_checkpoint_per_root(plan: Plan, modules: Iterable[Any]) -> list[str]:
    """``resolve_checkpoint`` for each model of a trace's module tree on its own, as
    ``apply`` resolves it per model it prepares (a GAN's two networks each get their own
    repeated blocks); paths prefixed back.  Roots without parameters (a loss module) are
    skipped, and so is a model the plan finds nothing in while another takes it; one
    model (or a trace that marks no roots): ``resolve_checkpoint`` itself."""
    entries = module_entries(modules)
    roots = [m.path for m in entries if m.root and m.total_parameter_count > 0]
    if len(roots) < 2:
        return resolve_checkpoint(plan, entries)
    chosen, first_error = [], None
    for root in roots:
        others = [r for r in roots if r != root and (root == "" or r.startswith(root + "."))]
        inside = [m for m in entries if (root == "" or m.path == root
                                         or m.path.startswith(root + "."))
                  and not any(m.path == r or m.path.startswith(r + ".") for r in others)]
        relative = [ModuleEntry("" if m.path == root else m.path[len(root) + 1:] if root
                                else m.path, m.type, m.total_parameter_count) for m in inside]
        try:
            paths = resolve_checkpoint(plan, relative)
        except PlanError as exc:
            first_error = first_error or exc
            continue
        chosen += [".".join(p for p in (root, path) if p) for path in paths]
    if not chosen and first_error is not None:
        raise first_error
    return chosen


def resolve_checkpoint(plan: Plan, modules: Iterable[Any]) -> list[str]:
    """Module paths ``plan.checkpoint`` selects (outermost only), or PlanError."""
    entries = module_entries(modules)
    if plan.checkpoint == "none":
        return []
    if plan.checkpoint == "auto":
        chosen = auto_checkpoint_modules(entries)
        if not chosen:
            raise PlanError("checkpoint=auto found no repeated blocks (a ModuleList or "
                            "Sequential of same-class modules); name modules instead, "
                            "e.g. checkpoint=encoder+decoder")
        return chosen
    chosen = []
    for name in plan.checkpoint:
        hits = [m.path for m in entries if m.path == name or m.type == name]
        if not hits:
            hint = ", ".join(repeated_blocks(entries)[:3]) or "see the module tree"
            raise PlanError(f"checkpoint names {name!r} but the model has no module with that "
                            f"path or class (repeated blocks: {hint})")
        chosen.extend(hits)
    # checkpointing a module inside one already checkpointed adds recomputation, saves nothing
    outer = [p for p in dict.fromkeys(chosen)
             if not any(p != q and (q == "" or p.startswith(q + ".")) for q in chosen)]
    return outer


def pipeline_stage_ranges(num_blocks: int, num_stages: int) -> list[range]:
    """Contiguous, balanced block index ranges per pipeline stage, the first stages taking
    the extra blocks: the one rule apply's stages and the simulator's follow."""
    if num_blocks < num_stages:
        raise PlanError(f"{num_stages} pipeline stages need at least {num_stages} repeated "
                        f"blocks to give each stage one; the model has {num_blocks}")
    base, extra = divmod(num_blocks, num_stages)
    ranges, start = [], 0
    for stage in range(num_stages):
        size = base + (stage < extra)
        ranges.append(range(start, start + size))
        start += size
    return ranges
