"""What a framework script rewritten by memadvisor calls at run time: ``expect_plan`` first
(refuse what this machine cannot run, then watch the run), ``split_batch`` in its
configuration lines, and ``finish`` (from ``memadvisor.apply.launch``) after it.

The framework realises the plan with its own knobs, so memadvisor cannot trust a keyword:
accelerate and the HF Trainer on a CPU-only machine accept an FSDP config and run DDP or
nothing.  So the run is *measured* until its first optimizer step, through torch's global
module and optimizer hooks: forward passes per step (accumulation), autocast inside the
forward (precision), a module of the model called again inside backward (recomputation), the wrapper the model runs under and the world size (sharding), the
optimizer's class.  A knob that did not take effect stops the run there, naming it.
"""
from __future__ import annotations

import importlib.util
import math
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import (register_module_forward_hook,
                                     register_module_forward_pre_hook)
from torch.optim.optimizer import register_optimizer_step_post_hook

from ...errors import UserError
from ...plan import Environment, Plan, PlanError, environment_problems
from .expectations import (  # noqa: F401  (cpu_target_refusal: the old home)
    FSDP_ON_CPU, LABELS, _expected_plan, _fsdp_needs_cuda, cpu_target_refusal,
)

_probe: "Probe | None" = None


class Probe:
    def __init__(self, plan: Plan, framework: str, device_type: str):
        self.plan, self.framework, self.device_type = plan, framework, device_type
        self.root: nn.Module | None = None
        self.root_members: set[int] = set()
        self.depth = 0
        self.forward_passes = 0
        self.recomputed = 0
        self.autocast_dtypes: set[torch.dtype] = set()
        self.verified: str | None = None
        self.handles = [register_module_forward_pre_hook(self._enter),
                        register_module_forward_hook(self._leave),
                        register_optimizer_step_post_hook(self._stepped)]

    # --- watching -----------------------------------------------------------------------
    def _enter(self, module, _inputs):
        if _in_backward():
            # recomputation; depth is not tracked there: checkpoint stops a recompute early
            # (its forward hooks never run) once it has the tensors backward needs
            if id(module) in self.root_members:
                self.recomputed += 1
            return
        if self.depth == 0 and torch.is_grad_enabled() and module.training:
            if self.root is None and any(True for _ in module.parameters()):
                self.root = module
                self.root_members = {id(m) for m in module.modules()}
                self.forward_passes += 1
            elif module is self.root:
                self.forward_passes += 1
        elif self.depth > 0 and torch.is_autocast_enabled(self.device_type):
            self.autocast_dtypes.add(torch.get_autocast_dtype(self.device_type))
        self.depth += 1

    def _leave(self, _module, _inputs, _output):
        if not _in_backward():
            self.depth = max(0, self.depth - 1)

    def _stepped(self, optimizer, _args, _kwargs):
        if self.verified is not None:
            return
        problems, facts = self.check(optimizer)
        self.verified = "; ".join(facts)
        for handle in self.handles:
            handle.remove()
        if problems:
            raise PlanError(f"plan {self.plan} did not take effect under "
                            f"{LABELS[self.framework]}: {'; '.join(problems)}")
        if _rank() == 0:
            print(f"memadvisor: plan {self.plan} checked at the first optimizer step: "
                  f"{self.verified}", file=sys.stderr, flush=True)

    # --- judging ------------------------------------------------------------------------
    def check(self, optimizer) -> tuple[list[str], list[str]]:
        plan, problems, facts = self.plan, [], []
        if self.forward_passes != plan.accum:
            problems.append(f"accum={plan.accum}: {self.forward_passes} forward pass(es) before "
                            "the first optimizer step")
        facts.append(f"{self.forward_passes} forward pass(es) per step")
        if plan.precision.startswith("amp-"):
            wanted = torch.bfloat16 if plan.precision == "amp-bf16" else torch.float16
            if wanted not in self.autocast_dtypes:
                seen = ", ".join(str(d) for d in self.autocast_dtypes) or "no autocast"
                problems.append(f"precision={plan.precision}: the forward ran with {seen}")
            facts.append(f"autocast {wanted} in the forward")
        elif plan.precision == "bf16":
            dtypes = {p.dtype for p in self.root.parameters()} if self.root is not None else set()
            if dtypes != {torch.bfloat16}:
                problems.append(f"precision=bf16: parameters are {sorted(map(str, dtypes))}")
            facts.append("parameters in bfloat16")
        if plan.checkpoint != "none":
            if not self.recomputed:
                problems.append(f"{Plan(checkpoint=plan.checkpoint)}: no module of the "
                                "model was recomputed in backward")
            facts.append(f"{self.recomputed} module call(s) recomputed in backward")
        problems += self._check_ranks(facts)
        problems += _check_optimizer(plan, optimizer, facts)
        return problems, facts

    def _check_ranks(self, facts: list[str]) -> list[str]:
        plan = self.plan
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world != plan.world:
            return [f"world={plan.world}: the run has {world} rank(s)"]
        if plan.world == 1:
            return []
        wrapper = _wrapper(self.root)
        facts.append(f"{wrapper} on {world} ranks")
        wanted = {"ddp": ("DistributedDataParallel",), "zero2": ("FSDP2", "SHARD_GRAD_OP",
                                                                  "_HYBRID_SHARD_ZERO2"),
                  "zero3": ("FSDP2", "FULL_SHARD", "HYBRID_SHARD")}.get(plan.shard, ())
        if not any(w in wrapper for w in wanted):
            hint = (" (accelerate distributes on a machine without CUDA only with "
                    "Accelerator(cpu=True))" if self.framework == "accelerate"
                    and self.device_type == "cpu" else "")
            return [f"shard={plan.shard}: the model ran as {wrapper}{hint}"]
        return []


def _in_backward() -> bool:
    """Inside autograd's backward pass (the test torch.utils.checkpoint itself uses)."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is not None and current() != -1


def _wrapper(root: nn.Module | None) -> str:
    """How the model is distributed: DistributedDataParallel, FSDP(<strategy>), FSDP2 or its
    own class (not distributed)."""
    if root is None:
        return "no model"
    from torch.distributed.fsdp import FullyShardedDataParallel
    for module in root.modules():
        if isinstance(module, FullyShardedDataParallel):
            return f"FSDP({module.sharding_strategy.name})"
    if any(hasattr(p, "full_tensor") for p in root.parameters()):
        return "FSDP2 (DTensor parameters)"
    return type(root).__name__


def _check_optimizer(plan: Plan, optimizer, facts: list[str]) -> list[str]:
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer
    name = type(inner).__name__
    facts.append(f"optimizer {name}")
    wanted = {"sgd": "SGD", "sgd-momentum": "SGD", "adafactor": "Adafactor",
              "adam8bit": "8bit"}.get(plan.optimizer)
    if wanted is not None and wanted not in name and wanted not in type(inner).__module__:
        return [f"optimizer={plan.optimizer}: the step ran {name}"]
    momentum = getattr(inner, "defaults", {}).get("momentum", 0.0)
    if plan.optimizer.startswith("sgd") and (momentum > 0) != (plan.optimizer == "sgd-momentum"):
        return [f"optimizer={plan.optimizer}: the step ran SGD with momentum {momentum}"]
    return []


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


# --- the calls a rewritten script makes ----------------------------------------------------
def expect_plan(plan: str, framework: str) -> None:
    """Refuse what this machine cannot run, then watch the run until its first step."""
    global _probe
    plan_obj = Plan.parse_spec(plan)
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    problems = machine_problems(plan_obj, framework)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != plan_obj.world:
        problems.append(f"the plan is for world={plan_obj.world} but this run has {world} "
                        f"process(es): run it with memadvisor apply --nproc {plan_obj.world}")
    if problems:
        raise PlanError(problems[0])
    if _probe is not None:
        for handle in _probe.handles:
            handle.remove()
    _probe = Probe(plan_obj, framework, device_type)


def machine_problems(plan: Plan, framework: str) -> list[str]:
    """Why this machine cannot run ``plan`` under ``framework`` (empty when it can)."""
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    problems = environment_problems(plan, Environment(
        device_type=device_type, fp16_supported=device_type == "cuda",
        bf16_supported=torch.cuda.is_bf16_supported() if device_type == "cuda" else True,
        bitsandbytes_available=importlib.util.find_spec("bitsandbytes") is not None))
    if plan.uses_fsdp and device_type != "cuda":
        problems.insert(0, _fsdp_needs_cuda(plan, framework))
    return problems


def refuse_before_launch(script) -> None:
    """For a rewritten framework script, what ``expect_plan`` would refuse on every rank,
    refused once before torchrun starts any."""
    try:
        text = open(script, encoding="utf-8").read()
    except (OSError, UnicodeDecodeError):
        return
    expected = _expected_plan(text)
    if expected is not None:
        problems = machine_problems(*expected)
        if problems:
            raise PlanError(problems[0])


def split_batch(batch_size: int, parts: int) -> int:
    """``batch_size / parts`` (micro-batches x ranks), refusing a batch that does not split."""
    if not isinstance(batch_size, int) or batch_size % parts or batch_size < parts:
        raise PlanError(f"a batch of {batch_size} samples cannot be split evenly into {parts} "
                        f"parts (micro-batches x ranks): the batch must be a multiple of {parts}")
    return batch_size // parts


def without_cuda() -> bool:
    """True on a machine without CUDA: what the framework's own switch (``Accelerator(cpu=)``,
    ``TrainingArguments(use_cpu=)``) must say for it to distribute there at all.  Asked
    when the script runs, so the rewritten script still uses the GPUs of a machine that has
    them."""
    return not torch.cuda.is_available()


def optimizer_steps(batches: int, accum: int) -> int:
    """Optimizer steps in ``batches`` micro-batches: accelerate also steps on a last,
    shorter group at the end of the loader."""
    return math.ceil(batches / accum)


def checkpointed(model: nn.Module) -> nn.Module:
    """``model`` with the plan's checkpointing applied in place (the names and the module
    tree stay), for frameworks that take the model as it is (accelerate's ``prepare``)."""
    from ..checkpointing import apply_checkpointing
    if _probe is None:
        raise PlanError("checkpointed() needs expect_plan() first (the rewritten script's "
                        "second line)")
    apply_checkpointing(model, _probe.plan)
    return model


def ranks_per_node(world: int) -> int:
    """Lightning's ``devices``: the ranks torchrun started on this node (``world`` when the
    script runs without torchrun, which ``expect_plan`` refuses for world > 1)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world))


def nodes(world: int) -> int:
    """Lightning's ``num_nodes``: the plan's world over the ranks on this node."""
    return max(1, world // ranks_per_node(world))


def finish(save_parameters: str | None = None, completed: bool = True) -> None:
    """After the script: stop with an error when the plan was never checked (no optimizer
    step ran under it); save the model's full parameters (rank 0 writes)."""
    global _probe
    probe, _probe = _probe, None
    if probe is None:
        return
    for handle in probe.handles:
        handle.remove()
    if not completed:
        return
    if probe.verified is None:
        raise UserError(f"plan {probe.plan} was never checked: no optimizer step ran under "
                        f"{LABELS[probe.framework]} (nothing shows the plan took effect)")
    if save_parameters and probe.root is not None:
        parameters = full_parameters(probe.root)
        if _rank() == 0:
            torch.save({"plan": str(probe.plan), "names": list(parameters),
                        "tensors": list(parameters.values())}, save_parameters)


WRAPPER_PREFIXES = ("module.", "_forward_module.", "_orig_mod.")
WRAPPER_PARTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def full_parameters(root: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, on the CPU, by the user's names (wrappers' prefixes removed);
    a collective under FSDP."""
    import contextlib

    from torch.distributed.fsdp import FullyShardedDataParallel
    fsdp1 = any(isinstance(m, FullyShardedDataParallel) for m in root.modules())
    gather = (FullyShardedDataParallel.summon_full_params(root, writeback=False) if fsdp1
              else contextlib.nullcontext())
    result = {}
    with gather:
        for name, parameter in root.named_parameters():
            value = parameter.detach()
            if hasattr(value, "full_tensor"):
                value = value.full_tensor()
            result[user_parameter_name(name)] = value.cpu().clone()
    return result


def user_parameter_name(name: str) -> str:
    for part in WRAPPER_PARTS:
        name = name.replace(part, "")
    changed = True
    while changed:
        changed = False
        for prefix in WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, changed = name[len(prefix):], True
    return name


def lightning_checkpointing():
    """A Lightning ``Callback`` that applies the plan's checkpointing to the LightningModule
    in ``setup``, before the strategy wraps it (``memadvisor.apply.checkpointing``: torch's
    non-reentrant checkpoint around the chosen blocks)."""
    if "lightning" in sys.modules:
        from lightning.pytorch import Callback
    else:
        from pytorch_lightning import Callback
    from ..checkpointing import apply_checkpointing

    plan = _probe.plan if _probe is not None else Plan()

    class MemadvisorCheckpointing(Callback):
        def setup(self, trainer, pl_module, stage):
            if stage == "fit" and not getattr(pl_module, "_memadvisor_checkpointed", False):
                apply_checkpointing(pl_module, plan)
                pl_module._memadvisor_checkpointed = True

    return MemadvisorCheckpointing()


def repeated_blocks_policy():
    """An FSDP auto-wrap policy wrapping the model's repeated blocks (``plan.repeated_blocks``,
    the same units memadvisor's own zero2/zero3 shards): torch's ``CustomPolicy``, whose
    first call is the root module."""
    from torch.distributed.fsdp.wrap import CustomPolicy

    from ...plan import repeated_blocks
    from ..checkpointing import module_entries
    chosen: set[int] = set()

    def wrap(module: nn.Module) -> bool:
        if not chosen:
            paths = set(repeated_blocks(module_entries(module)))
            chosen.update(id(m) for p, m in module.named_modules() if p in paths)
            chosen.add(-1)  # computed (a model without repeated blocks wraps the root only)
        return id(module) in chosen

    return CustomPolicy(wrap)

