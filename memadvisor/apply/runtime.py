"""The calls a rewritten script makes: prepare, micro_batches, backward, step, unscale_,
clip_grad_norm_.

Each ``prepare`` makes a ``Session`` for one model and the optimizer that trains it (a GAN
prepares two); the process keeps them as module state, like ``torch.distributed``'s default
group, with one plan and one loss scaler for all.  ``micro_batches`` works on the latest
session.  ``step`` refuses an optimizer ``prepare`` never saw (the plan would not have been
applied) and, before each optimizer's first step, checks that every knob of the plan took
effect (checks.py).
"""
from __future__ import annotations

import atexit
import contextlib
import gc
import importlib.util
import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn

from ..plan import Environment, Plan, PlanError, environment_problems, repeated_blocks
from . import (batch_watch, batching, checkpointing, checks, optimizers,
               pipeline_data_parallel, pipeline_parallel, precision, sharding, tensor_parallel)

_session: "Session | None" = None  #: the latest session (micro_batches splits for it)
_sessions: "list[Session]" = []
_owns_process_group = False


class Session:
    def __init__(self, plan: Plan, module: nn.Module, model: nn.Module,
                 optimizer: torch.optim.Optimizer, ranks: sharding.Ranks,
                 parameter_names: list[str], scaler, checkpointed: list[str],
                 evidence: checks.Evidence | None = None,
                 names_by_id: dict[int, str] | None = None):
        self.plan = plan
        self.module = module  #: the unwrapped model (FSDP modules are changed in place)
        self.model = model  #: what the script calls (a DDP wrapper or ``module``)
        self.optimizer = optimizer
        self.ranks = ranks
        self.parameter_names = parameter_names  #: in the script's optimizer order
        self.scaler = scaler  #: the plan's GradScaler (amp-fp16), shared by every session
        self.checkpointed = checkpointed
        self.evidence = evidence or checks.Evidence()  #: shared by sessions of one model
        self.names_by_id = names_by_id or {}  #: the script's parameters (by id) -> name
        self.micro_batches_per_step = 1
        self.unscaled = False  #: GradScaler.unscale_ already ran since the last step
        self.checked = False  #: the knobs were checked (before this optimizer's first step)
        self.last_step = -1  #: when this optimizer last stepped (a process-wide count)
        self.backwards = 0  #: backward calls since the last step
        self.weighted_backwards = 0  #: of which inside micro_batches (loss scaled 1/accum)
        self.coupling_checked = False  #: the first micro-batch was watched (batch_watch)
        self.coupling_watch = None  #: its CouplingWatch while its loss is being made

    def loss_weight(self) -> float:
        return 1.0 / self.micro_batches_per_step

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, on the CPU, by name, in the script's optimizer order
        (a collective under FSDP: every rank must call it)."""
        if self.plan.pp > 1:  # each stage holds its own blocks: gathered from their ranks
            return pipeline_parallel.full_parameters(self.module, self.parameter_names)
        params = dict(self.module.named_parameters())
        result = {}
        for name in self.parameter_names:
            value = params[name].detach()
            if hasattr(value, "full_tensor"):
                value = value.full_tensor()
            result[name] = value.cpu().clone()
        return result


def _environment(device_type: str) -> Environment:
    cuda = device_type == "cuda"
    return Environment(
        device_type=device_type,
        bf16_supported=torch.cuda.is_bf16_supported() if cuda else True,
        fp16_supported=cuda,
        bitsandbytes_available=importlib.util.find_spec("bitsandbytes") is not None,
    )


def prepare(model: nn.Module, optimizer: torch.optim.Optimizer, plan: Plan | str = "none",
            methods: list[str] | tuple[str, ...] = ()):
    """Apply ``plan`` to the model and optimizer; returns the pair the script should use.

    Called once per (model, optimizer) pair; a model prepared before (given again as what
    prepare returned) is not wrapped twice.  ``methods``: the model's own methods the script
    calls besides ``forward`` (forwarded through the wrapper, see
    ``sharding.forward_methods``).
    """
    global _session, _owns_process_group
    plan = plan if isinstance(plan, Plan) else Plan.parse(plan)
    if _sessions and str(_sessions[0].plan) != str(plan):
        raise PlanError(f"prepare was called with plan {plan} after plan {_sessions[0].plan}: "
                        "one process runs one plan")
    if not isinstance(model, nn.Module):
        raise PlanError(f"prepare expects an nn.Module as the model, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise PlanError("prepare expects a torch.optim optimizer, got "
                        f"{type(optimizer).__name__} (made by a call memadvisor cannot see "
                        "into: return a torch.optim.Optimizer from it)")
    earlier = next((s for s in _sessions if s.model is model or s.module is model), None)
    if earlier is not None:
        return _prepare_another_optimizer(earlier, optimizer)
    ranks = sharding.read_ranks()
    sharding.check_world(plan, ranks)
    first = next(model.parameters(), None)
    device_type = first.device.type if first is not None else "cpu"
    problems = environment_problems(plan, _environment(device_type))
    if problems:
        raise PlanError(problems[0])

    names_by_id = {id(p): name for name, p in model.named_parameters()}
    parameter_names = _parameter_names(optimizer, names_by_id, type(model).__name__)
    optimizers.check_rebuildable(optimizer, plan)
    optimizers.check_shardable(optimizer, plan)

    if sharding.init_process_group(device_type, ranks):
        _owns_process_group = True
        atexit.register(finish)
    module, warning = sharding.convert_batch_norm(model, plan, device_type)
    if warning and ranks.rank == 0:
        warnings.warn(f"memadvisor: {warning}", stacklevel=2)
    evidence = checks.Evidence()
    precision.cast_parameters(module, plan)
    checkpointed = checkpointing.apply_checkpointing(module, plan, evidence)
    precision.wrap_forward(module, plan, device_type, evidence)
    batch_watch.watch_first_forward(module, plan.precision)
    tp_layout = tensor_parallel.apply_tensor_parallel(module, plan, device_type)
    blocks = repeated_blocks(checkpointing.module_entries(module)) if plan.uses_fsdp else []
    # a pipeline shards (or averages) each stage's gradients over its data-parallel group
    # itself (pipeline_data_parallel): no DDP/FSDP wrapper around the whole model
    wrapped = (sharding.wrap_model(module, plan, device_type, blocks) if plan.pp == 1
               else module)
    checks.watch_wrapper(wrapped, evidence)
    sharding.watch_device(wrapped, plan, device_type)
    sharding.forward_methods(module, wrapped, plan, methods)

    new_params = dict(module.named_parameters())
    # (under pp zero1's group is a stage's, made with the pipeline: shard_optimizer)
    shard_group = (sharding.optimizer_shard_group(plan)
                   if plan.shard == "zero1" and plan.pp == 1 else None)
    # a pipeline shards the optimizer state over a stage's replicas once it holds the stage
    build_plan = pipeline_data_parallel.unsharded_optimizer_plan(plan)
    new_optimizer = optimizers.build_optimizer(optimizer, build_plan, new_params, names_by_id,
                                               shard_group)
    if plan.tp > 1:
        tensor_parallel.without_foreach(new_optimizer)
    if plan.pp > 1:  # after the optimizer is built over every parameter: then cut
        wrapped = pipeline_parallel.apply_pipeline(module, new_optimizer, plan, ranks.rank,
                                                   device_type, tp_layout)
        new_optimizer = pipeline_data_parallel.shard_optimizer(new_optimizer, optimizer, plan,
                                                               wrapped.groups)
    scaler = (_sessions[0].scaler if _sessions
              else precision.make_grad_scaler(plan, device_type))
    _session = Session(plan, module, wrapped, new_optimizer, ranks, parameter_names, scaler,
                       checkpointed, evidence, names_by_id)
    _sessions.append(_session)
    if ranks.rank == 0:
        print(f"memadvisor: {_describe(_session, device_type, blocks, tp_layout)}", file=sys.stderr,
              flush=True)
    return wrapped, new_optimizer


def _parameter_names(optimizer, names_by_id: dict[int, str], model_name: str) -> list[str]:
    missing = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in names_by_id]
    if missing:
        raise PlanError(f"the optimizer holds {len(missing)} tensors that are not parameters "
                        f"of the model given to prepare ({model_name})")
    return [names_by_id[id(p)] for g in optimizer.param_groups for p in g["params"]]


def _prepare_another_optimizer(earlier: Session, optimizer):
    """A second optimizer over (part of) a model prepared before: rebuilt over the model's
    current parameters, the model left as it is."""
    global _session
    plan = earlier.plan
    parameter_names = _parameter_names(optimizer, earlier.names_by_id,
                                       type(earlier.module).__name__)
    optimizers.check_rebuildable(optimizer, plan)
    optimizers.check_shardable(optimizer, plan)
    shard_group = sharding.optimizer_shard_group(plan) if plan.shard == "zero1" else None
    new_optimizer = optimizers.build_optimizer(optimizer, plan, dict(earlier.module.named_parameters()),
                                               earlier.names_by_id, shard_group)
    _session = Session(plan, earlier.module, earlier.model, new_optimizer, earlier.ranks,
                       parameter_names, earlier.scaler, earlier.checkpointed, earlier.evidence,
                       earlier.names_by_id)
    _sessions.append(_session)
    return earlier.model, new_optimizer


def _describe(session: Session, device_type: str, blocks: list[str],
              tp_layout: "tensor_parallel.Layout | None" = None) -> str:
    """One line saying what prepare did, so a run's log shows the plan it ran."""
    plan = session.plan
    parts = [f"plan {plan} on {device_type}"]
    if plan.world > 1:
        parts[0] += f" x {plan.world} ranks"
    if session.checkpointed:
        paths = [p or "<model>" for p in session.checkpointed]
        shown = ", ".join(paths[:3]) + (f", ... ({len(paths)})" if len(paths) > 3 else "")
        parts.append(f"checkpointing {shown}")
    if tp_layout is not None:
        parts.append(tensor_parallel.describe(tp_layout, plan.sp))
    if isinstance(session.model, pipeline_parallel.PipelineModel):
        parts.append(pipeline_parallel.describe(session.model))
    if plan.uses_fsdp:
        parts.append(f"fully_shard on {len(blocks)} blocks + the root")
    parts.append(f"optimizer {type(session.optimizer).__name__}")
    return "; ".join(parts)


def current_session() -> Session | None:
    return _session


def micro_batches(*values, batch_dims=None):
    """This rank's micro-batches of the batch ``values``: a tuple per micro-batch, or the
    value itself when one value is given.  Each tensor is cut along its own batch dimension
    (batching.py: sequence-first tensors along dimension 1, shared masks not at all);
    ``batch_dims`` (one entry per tensor, None = shared) settles layouts the shapes cannot.
    Under DDP every micro-batch but the last runs in ``no_sync`` (gradients are
    all-reduced once per step)."""
    session = _session
    if session is None:
        yield values if len(values) != 1 else values[0]
        return
    plan = session.plan
    no_sync = getattr(session.model, "no_sync", None)  # DDP (ddp, zero1)
    # the batch dims decided for the first batch, reused where a later one is ambiguous
    decided = getattr(session, "decided_batch_dims", None)
    if decided is None:
        decided = session.decided_batch_dims = {}
    session.micro_batches_per_step = plan.accum
    try:
        # a pipeline replica takes its B / D samples whole (the schedule cuts them into M)
        split_plan, split_rank = (
            pipeline_data_parallel.batch_split(plan, session.ranks.rank) if plan.pp > 1
            else (plan, tensor_parallel.data_parallel_rank(plan, session.ranks.rank)))
        for index, part in enumerate(batching.split(
                values, split_plan, split_rank,
                model=session.model, batch_dims=batch_dims,
                decided=decided)):
            last = index == plan.accum - 1
            _end_coupling_watch(session)
            if not session.coupling_checked and plan.pp == 1:  # the first micro-batch
                session.coupling_checked = True
                session.coupling_watch = batch_watch.start_coupling_watch(
                    values, part, plan.data_parallel_size * plan.accum, str(plan))
            with (no_sync() if no_sync is not None and not last else contextlib.nullcontext()):
                yield part if len(values) != 1 else part[0]
    finally:
        _end_coupling_watch(session)
        session.micro_batches_per_step = 1


def _end_coupling_watch(session: Session) -> None:
    """The first micro-batch's loss is made (``backward``) or the next one begins."""
    watch, session.coupling_watch = session.coupling_watch, None
    batch_watch.end_coupling_watch(watch)


def _active_scaler(script_scaler):
    """The scaler that scales the loss: the script's own GradScaler when it is enabled (the
    script also calls its ``update``), else the plan's (amp-fp16) or none."""
    if script_scaler is not None and script_scaler.is_enabled():
        return script_scaler
    return _session.scaler if _session is not None else None


def backward(loss: torch.Tensor, *args, scaler=None, **kwargs) -> None:
    """``loss.backward()``, scaled by 1/accum and by the active loss scaler."""
    session = _session
    if session is None:
        (scaler.scale(loss) if scaler is not None else loss).backward(*args, **kwargs)
        return
    if getattr(loss, "_memadvisor_pipeline", False):
        # the pipeline's schedule ran every micro-batch's backward inside the model call
        for each in _sessions:
            each.backwards += 1
        return
    if session.plan.pp > 1:
        raise PlanError(f"pp={session.plan.pp}: the loss given to backward is not the one the "
                        "pipelined model returned (the pipeline runs the backward itself)")
    _end_coupling_watch(session)
    weight = session.loss_weight()
    for each in _sessions:
        each.backwards += 1
        each.weighted_backwards += weight != 1.0
    if weight != 1.0:
        loss = loss * weight
    active = _active_scaler(scaler)
    if active is not None:
        loss = active.scale(loss)
    loss.backward(*args, **kwargs)


def _session_of(optimizer) -> Session:
    for session in _sessions:
        if session.optimizer is optimizer:
            return session
    if not _sessions:
        raise PlanError("memadvisor stopped before the first optimizer step: mem.prepare never "
                        "ran, so no knob of the plan was applied (it follows the optimizer's "
                        "creation, which this run skipped)")
    raise PlanError("memadvisor stopped before an optimizer step: the optimizer stepped is not "
                    "one mem.prepare returned, so the plan does not apply to it (prepare each "
                    "optimizer, and step the one prepare returned)")


def step(optimizer: torch.optim.Optimizer, *args, scaler=None, **kwargs):
    """``optimizer.step(...)``, through the active loss scaler; before an optimizer's first
    step, stops if a knob of the plan did not take effect."""
    session = _session_of(optimizer)
    plan = session.plan
    closure = args[0] if args else kwargs.pop("closure", None)
    args = args[1:]
    if not session.checked and closure is None:
        _check_knobs(session)
    if closure is not None:
        if not session.checked:
            # the forward and backward run inside the closure: check after its first run,
            # before the optimizer changes anything
            closure = _checked_after(closure, session)
        if plan.accum > 1:
            raise PlanError(f"accum={plan.accum}: the optimizer steps with a closure, which it "
                            "may call several times per step; micro-batches cannot be split "
                            "inside it")
        if plan.world > 1:
            closure = _mean_over_ranks(closure)
        args = (closure, *args)
    active = _active_scaler(scaler)
    if active is None:
        result = optimizer.step(*args, **kwargs)
    else:
        result = active.step(optimizer, *args, **kwargs)
        if active is not scaler:  # the plan's scaler: the script does not update it
            active.update()
            for each in _sessions:
                each.unscaled = False
    session.unscaled = False
    session.last_step = 1 + max(each.last_step for each in _sessions)
    for each in _sessions:
        if each.optimizer is optimizer or each.model is session.model:
            each.backwards = each.weighted_backwards = 0
    return result


def _check_knobs(session: Session) -> None:
    checks.check(session.plan, session.evidence, session.module, type(session.module).__name__,
                 session.weighted_backwards, session.backwards, bool(session.checkpointed))
    session.checked = True


def _checked_after(closure, session: Session):
    def run():
        loss = closure()
        if not session.checked:
            _check_knobs(session)
        return loss
    return run


def _mean_over_ranks(closure):
    """The closure's loss averaged over the ranks: each rank computes it on its slice, and
    the optimizer (LBFGS) decides from it how often to re-evaluate: every rank must see the
    full batch's loss or they would diverge."""
    def run():
        loss = closure()
        if loss is None:
            return loss
        value = loss.detach().clone()
        dist.all_reduce(value)
        return value / dist.get_world_size()
    return run


def unscale_(optimizer: torch.optim.Optimizer, scaler=None) -> None:
    """``scaler.unscale_(optimizer)`` for the scaler that scaled the loss (once per step)."""
    if not _sessions:
        if scaler is not None:
            scaler.unscale_(optimizer)
        return
    session = _session_of(optimizer)
    active = _active_scaler(scaler)
    if active is not None and not session.unscaled:
        active.unscale_(optimizer)
        session.unscaled = True


def _unscale(parameters) -> None:
    """Unscale the gradients of every optimizer holding one of ``parameters``."""
    if not _sessions or _sessions[0].scaler is None:
        return
    wanted = {id(p) for p in ([parameters] if isinstance(parameters, torch.Tensor)
                              else parameters)}
    for session in _sessions:
        held = {id(p) for g in session.optimizer.param_groups for p in g["params"]}
        if held & wanted and not session.unscaled:
            session.scaler.unscale_(session.optimizer)
            session.unscaled = True


def clip_grad_norm_(parameters, max_norm, *args, **kwargs) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` on true-scale gradients; the norm as a plain tensor
    (FSDP2 returns a DTensor)."""
    parameters = list(parameters) if not isinstance(parameters, torch.Tensor) else parameters
    _unscale(parameters)
    if _sessions and _sessions[0].plan.pp > 1:
        model = _sessions[0].model
        replicated = {id(p) for p in getattr(model, "replicated", ())}
        return pipeline_parallel.clip_grad_norm_(parameters, max_norm, replicated, *args,
                                                 **kwargs)
    if _sessions and _sessions[0].plan.tp > 1:
        # split Linears' DTensor gradients beside replicated plain ones (or, under FSDP,
        # DTensors of a 2-D and a 1-D mesh): torch's foreach norm refuses either mix
        return tensor_parallel.clip_mixed_grad_norm_(parameters, max_norm, *args, **kwargs)
    norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm, *args, **kwargs)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def clip_grad_value_(parameters, clip_value, *args, **kwargs):
    parameters = list(parameters) if not isinstance(parameters, torch.Tensor) else parameters
    _unscale(parameters)
    return torch.nn.utils.clip_grad_value_(parameters, clip_value, *args, **kwargs)


def unwrap(model: nn.Module) -> nn.Module:
    """The script's own model behind a DistributedDataParallel wrapper."""
    return getattr(model, "module", model) if isinstance(
        model, nn.parallel.DistributedDataParallel) else model


def finish(save_parameters: str | None = None, destroy_process_group: bool = True) -> None:
    """End the sessions: optionally save the full parameters of every prepared model (rank 0
    writes), then leave the process group if prepare created it."""
    global _session, _owns_process_group
    sessions, _session = list(_sessions), None
    _sessions.clear()
    if sessions and save_parameters:
        # names/tensors: the optimizer stepped last (what a run is compared by, as with one
        # optimizer); every session's under "sessions"
        every = [session.full_parameters() for session in sessions]
        last = max(range(len(sessions)), key=lambda i: sessions[i].last_step)
        if sessions[0].ranks.rank == 0:
            torch.save({"plan": str(sessions[0].plan), "names": list(every[last]),
                        "tensors": list(every[last].values()),
                        "sessions": [{"names": list(p), "tensors": list(p.values())}
                                     for p in every]}, save_parameters)
    del sessions
    if destroy_process_group and _owns_process_group and dist.is_initialized():
        # DDP and ZeroRedundancyOptimizer objects still alive when the group goes away
        # can abort the process at exit ("terminate called without an active exception")
        gc.collect()
        dist.destroy_process_group()
        _owns_process_group = False
