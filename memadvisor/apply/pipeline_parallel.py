"""``pp=P``: pipeline parallelism with PyTorch's own ``torch.distributed.pipelining``.

The model's repeated-block stack (``plan.repeated_blocks``: the largest ModuleList or
Sequential of same-class blocks) is cut into P contiguous stages, one per rank.  Rather than
re-expressing the model's forward as stage modules (the ``pipeline()`` tracer is fragile,
and a hand-written split needs to know the forward's code), every stage runs **the model's
own forward** with module hooks:

- blocks of other stages are replaced by ``_Skip`` (returns its first argument): their
  parameters leave this rank;
- a stage after the first swaps its first block's input for the activation it received
  from the previous stage (so whatever else the forward hands each block -- a rope table,
  a mask -- is computed by the forward itself, as torchtitan keeps ``freqs_cis`` as a
  buffer on every stage);
- a stage before the last stops at its last block's output (``_StageDone``) and sends it;
- the last stage runs on to the model's output and hands the schedule its loss: the one
  the output holds (``_, loss = model(x, y)``), or the script's loss expression applied
  to it (``with_loss``: the rewrite made that expression a function, loss_expression.py).

The layers outside the stack (embeddings, final norm, head) stay on every rank in this
increment: only the first stage's embedding and the last stage's head take part in the
math, and their gradients (zero elsewhere) are summed over the stages after each step's
schedule, which also makes a weight tied between the embedding and the head (GPT) right.

``ScheduleGPipe`` / ``Schedule1F1B`` run ``microbatches=M`` micro-batches, the gradients
divided by M after the schedule: the mean-loss math of the unmodified step.  Under
``schedule=interleaved`` the stack is cut into P x V stages and rank r holds stages r,
r + P, ...: V ``_Stage`` modules over the one model, each entered and left at its own
blocks, the rank's other blocks passing the stream through while it runs
(``ScheduleInterleaved1F1B``).  The forward must be embed -> blocks -> head: a block's input that is not the previous
block's output (the forward changes the stream between blocks, or calls a block twice) is
refused on the first batch, on every rank alike, as is a model whose output holds no loss
when the script gives no loss function.

The loss function runs inside the last stage's forward (the schedule's own ``loss_fn`` is
the identity; why: pipeline_loss.py), the batch tensors it reads travel as keyword
arguments of the schedule's step, cut into the same micro-batches as the model's inputs.
With ``shard=ddp`` D such pipelines run side by side (pipeline_data_parallel.py).
"""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch import nn

from ..plan import Plan, PlanError, pipeline_stage_ranges, repeated_blocks
from . import checkpointing, gloo_release, pipeline_collectives, pipeline_data_parallel
from .pipeline_collectives import clip_grad_norm_, full_parameters  # noqa: F401 (runtime's)
from .pipeline_loss import check_loss, entered, loss_position, parameter_name
from .pipeline_schedule import build_schedule, describe  # noqa: F401 (runtime's)

_ARG = "_memadvisor_arg"  #: the script's positional arguments travel as keyword arguments
_TARGET = "_memadvisor_target"  #: the batch tensors the script's loss function reads


class _StageDone(Exception):
    """Raised by the hook on a stage's last block to leave the model's forward early."""

    def __init__(self, output):
        super().__init__("stage output")
        self.output = output


class _Skip(nn.Module):
    """A block held by another stage: its input passes through."""

    def forward(self, x, *args, **kwargs):
        return x


stage_ranges = pipeline_stage_ranges  #: the rule lives with the plan (plan.py)


def _settle(discarded) -> None:
    """Wait on the stream a later stage's forward computed and then set aside for the one it
    received: under tp the embedding's output is the result of an asynchronous all-reduce
    that nothing else would wait on, and torch keeps an unwaited collective's output alive
    (measured: two more 32 KiB tensors per step on the Llama decoder's last stage)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    if isinstance(discarded, AsyncCollectiveTensor):
        discarded.wait()


class _Stage(nn.Module):
    """What ``PipelineStage`` runs: the model's own forward, entered or left at this stage's
    blocks by the hooks ``PipelineModel`` installs (a rank holds V of them under
    ``schedule=interleaved``, each the same model entered at other blocks)."""

    def __init__(self, owner: "PipelineModel", stage_index: int, blocks: range,
                 num_args: int, num_targets: int, is_last: bool, position):
        super().__init__()
        self.model = owner.module
        object.__setattr__(self, "owner", owner)  # not a submodule: no cycle in modules()
        self.stage_index = stage_index
        self.blocks = blocks
        self.num_args = num_args
        self.num_targets = num_targets
        self.is_last = is_last
        self.position = position
        self.received = None
        self.loss_fn = None  #: the script's loss function (set for each step: ``with_loss``)
        self.context = None  #: makes the script's ``with`` context around its forward, or None

    def forward(self, *received, **kwargs):
        args = [kwargs.pop(f"{_ARG}{i}") for i in range(self.num_args)]
        targets = [kwargs.pop(f"{_TARGET}{i}") for i in range(self.num_targets)]
        self.received = received[0] if received else None
        self.owner.active = self
        try:
            with entered(self.context):
                output = self.model(*args, **kwargs)
        except _StageDone as done:
            return done.output
        finally:
            self.received = None
            self.owner.active = None
        kind, where = self.position
        if kind == "loss_fn":
            return self.loss_fn(output, *targets)
        return output if kind == "tensor" else output[where[1]]


class PipelineModel(nn.Module):
    """What the script calls under ``pp``: one call runs the whole pipeline schedule --
    forward and backward of every micro-batch -- and returns the model's output with the
    loss (the mean over micro-batches, on every rank) in its place and None for the rest."""

    def __init__(self, module: nn.Module, plan: Plan, rank: int, blocks: list[str],
                 chunks: list[range], device: torch.device,
                 groups: pipeline_data_parallel.Groups | None = None, optimizer=None):
        super().__init__()
        self.groups = groups or pipeline_data_parallel.Groups()
        self.module = module
        self.plan = plan
        self.stage_index = rank  #: this rank's place in the pipeline (its first stage)
        self.num_stages = plan.pipeline_stages  #: P x V
        self.stage_indices = [c * plan.pp + rank for c in range(len(chunks))]
        self.block_paths = blocks
        self.chunks = chunks  #: per stage this rank holds: its block indices
        self.owned = chunks[0] if len(chunks) == 1 else [i for c in chunks for i in c]
        self.device = device
        self.schedule = None
        self.stages: list = []  #: this rank's PipelineStages
        self.active = None  #: the _Stage whose forward runs now (None: the dry run)
        self.position = None
        self.with_loss_function = None  #: whether the first step came with a loss function
        self.dry_run = False
        #: under ``sp``: (cut, whole) of the stream along the sequence (tensor_parallel.py);
        #: the stream between stages travels cut, so the dry run enters and leaves this
        #: rank's blocks as the stages do
        self.sequence = None
        #: block index -> a weak reference to its output in this forward (for the check that
        #: the next block takes it; weak so it keeps no activation alive)
        self.outputs: dict[int, weakref.ref] = {}
        modules = dict(module.named_modules())
        for index, path in enumerate(blocks):
            parent, _, leaf = path.rpartition(".")
            if index not in self.owned:
                setattr(modules[parent] if parent else module, leaf, _Skip())
        modules = dict(module.named_modules())
        pipeline_data_parallel.shard_blocks(module, [modules[blocks[i]] for i in self.owned],
                                            plan, self.groups, optimizer)
        #: the layers outside the stack (after FSDP made its parameters: zero2/zero3)
        self.replicated = [p for name, p in module.named_parameters()
                           if not any(name.startswith(b + ".") for b in blocks)]
        for index, path in enumerate(blocks):
            block = modules[path]
            # before FSDP's pre-forward (which hands the block new input tensors); after
            # its post-forward
            block.register_forward_pre_hook(self._make_pre_hook(index), prepend=True)
            block.register_forward_hook(self._make_hook(index))
            if len(chunks) > 1 and index in self.owned:
                block.forward = self._gated(index, block.forward)

    def _gated(self, index: int, forward):
        """A block of this rank's that another of its stages holds passes the stream through
        while that stage runs (a recomputation under checkpointing calls the inner forward,
        and the dry run has no stage: both run the block)."""
        def run(x, *args, **kwargs):
            active = self.active
            if active is not None and index not in active.blocks:
                return x
            return forward(x, *args, **kwargs)
        return run

    # --- hooks ---------------------------------------------------------------------------
    def _make_pre_hook(self, index: int):
        def pre_hook(block, args):
            if not args or not isinstance(args[0], torch.Tensor):
                raise PlanError(f"pp={self.plan.pp}: block {self.block_paths[index]} is not "
                                "called with the stream tensor as its first positional "
                                "argument, so stages cannot hand it on")
            previous = self.outputs.get(index - 1)
            if index > 0 and (previous is None or args[0] is not previous()):
                raise PlanError(
                    f"pp={self.plan.pp}: the model's forward does more than embed -> blocks "
                    f"-> head: block {self.block_paths[index]}'s input is not block "
                    f"{self.block_paths[index - 1]}'s output (the stream is changed between "
                    "blocks, or a block is called twice), so it cannot be cut into stages")
            active = self.active
            if (active is not None and index == active.blocks.start
                    and active.stage_index > 0 and not self.dry_run
                    and active.received is not None):
                _settle(args[0])
                return (active.received, *args[1:])
            if self.dry_run and self.sequence and index > 0 and index == self._first_owned:
                return (self.sequence[0](args[0]), *args[1:])
            return None
        return pre_hook

    def _make_hook(self, index: int):
        def hook(block, args, output):
            if not isinstance(output, torch.Tensor):
                raise PlanError(f"pp={self.plan.pp}: block {self.block_paths[index]} returns "
                                f"{type(output).__name__}, not one tensor to send to the next "
                                "stage")
            if (self.dry_run and self.sequence and index == self._last_owned
                    and index < len(self.block_paths) - 1):
                output = self.sequence[1](output)  # the rest of the model, whole
            self.outputs[index] = weakref.ref(output)
            active = self.active
            if (active is not None and index == active.blocks.stop - 1
                    and not active.is_last and not self.dry_run):
                self.outputs.clear()
                raise _StageDone(output)
            return output
        return hook

    @property
    def _first_owned(self) -> int:
        return min(self.owned)

    @property
    def _last_owned(self) -> int:
        return max(self.owned)

    # --- the schedule --------------------------------------------------------------------
    def _build(self, kwargs: dict, batch_size: int, loss_fn=None, context=None):
        """On the first batch: a no-grad run of one micro-batch through the model as this
        rank holds it (other stages' blocks skipped) finds the stream's shape and the loss
        in the output (or checks the script's loss function gives one); every rank runs the
        same checks, so a refusal stops all alike."""
        micro = batch_size // self.plan.pipeline_microbatches
        first = {k: (v[:micro] if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
        num_args = sum(k.startswith(_ARG) for k in kwargs)
        num_targets = sum(k.startswith(_TARGET) for k in kwargs)
        args = [first.pop(f"{_ARG}{i}") for i in range(num_args)]
        targets = [first.pop(f"{_TARGET}{i}") for i in range(num_targets)]
        stream = {}

        def grab(block, block_args):
            stream.setdefault("x", block_args[0])
        modules = dict(self.module.named_modules())
        # before sp's cut on block 0: the whole stream on every stage
        handle = modules[self.block_paths[0]].register_forward_pre_hook(grab, prepend=True)
        self.dry_run = True
        try:
            with torch.no_grad():
                with entered(context):
                    output = self.module(*args, **first)
                position = (("loss_fn", None) if loss_fn is not None
                            else loss_position(output))
                if loss_fn is not None:
                    check_loss(loss_fn(output, *targets), loss_fn, self.plan.pp)
        finally:
            self.dry_run = False
            handle.remove()
            self.outputs.clear()
        if position is None:
            raise PlanError(f"pp={self.plan.pp}: the model's output holds no loss (one 0-dim "
                            f"tensor; it returned {type(output).__name__}) and the script "
                            "computes its loss from the output but calls the model directly: "
                            "apply the pp plan to the original script, whose rewrite hands "
                            "that loss expression to the pipeline (`mem.with_loss`)")
        self.position = position
        x = stream["x"]
        shape = list(x.shape)
        if self.sequence:  # sp: the stream between stages is this rank's part of the sequence
            shape[1] //= self.plan.tp
        # the metadata's requires_grad decides whether received activations get gradients
        # (torch 2.13's PipelineStage takes it from the example tensors given here)
        meta = torch.empty(shape, dtype=x.dtype, device=self.device,
                           requires_grad=x.is_floating_point())
        del output
        self.stages, self.schedule = build_schedule(
            self.plan, [(index, _Stage(self, index, chunk, num_args, num_targets,
                                       index == self.num_stages - 1, position))
                        for index, chunk in zip(self.stage_indices, self.chunks)],
            meta, self.device, self.groups.pipeline)

    def forward(self, *args, **kwargs):
        return self._step(args, kwargs)

    def forward_with_loss(self, loss_fn, targets: tuple, context, *args, **kwargs):
        """The model called by ``with_loss``: the schedule computes ``loss_fn(output,
        *targets)`` on the last stage per micro-batch (each target cut as the inputs are),
        every stage's forward in ``context()`` when given; returns the step's mean loss."""
        for index, target in enumerate(targets):
            if not isinstance(target, torch.Tensor):
                raise PlanError(f"pp={self.plan.pp}: the loss reads "
                                f"`{parameter_name(loss_fn, index + 1)}`, a "
                                f"{type(target).__name__}, not a tensor the pipeline can cut "
                                "into micro-batches")
        return self._step(args, kwargs, loss_fn, targets, context)

    def _step(self, args: tuple, kwargs: dict, loss_fn=None, targets: tuple = (),
              context=None):
        if not torch.is_grad_enabled():
            raise PlanError(f"pp={self.plan.pp}: the pipelined model was called without "
                            "gradients (an evaluation under torch.no_grad): only training "
                            "steps run through the pipeline in this increment")
        batch = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)
                      and a.dim() > 0), None)
        if batch is None:
            raise PlanError(f"pp={self.plan.pp}: the model is called without a batch tensor")
        batch_size = batch.shape[0]
        pipeline_data_parallel.check_batch(self.plan, self.groups, batch_size,
                                           [*args, *kwargs.values(), *targets],
                                           first=self.schedule is None)
        for name, value in (*((f"argument {i}", a) for i, a in enumerate(args)),
                            *kwargs.items(),
                            *((f"`{parameter_name(loss_fn, i + 1)}`, read by the loss,", t)
                              for i, t in enumerate(targets))):
            if isinstance(value, torch.Tensor) and (value.dim() == 0
                                                   or value.shape[0] != batch_size):
                raise PlanError(f"pp={self.plan.pp}: {name} of the model call has shape "
                                f"{tuple(value.shape)}, not a batch of {batch_size} first: the "
                                "pipeline cuts every tensor argument into micro-batches")
        inputs = {f"{_ARG}{i}": a for i, a in enumerate(args)}
        inputs.update(kwargs)
        inputs.update({f"{_TARGET}{i}": t for i, t in enumerate(targets)})
        if self.schedule is None:
            self._build(inputs, batch_size, loss_fn, context)
            self.with_loss_function = loss_fn is not None
        if self.with_loss_function != (loss_fn is not None):
            raise PlanError(f"pp={self.plan.pp}: the model is called both with the script's "
                            "loss function and without it; one pipeline runs one of them")
        for stage in self.stages:
            stage.submod.loss_fn = loss_fn
            stage.submod.context = context
        losses: list[torch.Tensor] = []
        target = torch.zeros(batch_size, device=self.device)
        earlier = pipeline_collectives.set_aside_gradients(self.module)
        self.schedule.step(target=target, losses=losses, return_outputs=False, **inputs)
        self.outputs.clear()
        pipeline_collectives.align_gradient_layouts(self.module)
        self._scale_gradients()
        self._sum_replicated_gradients()
        pipeline_data_parallel.average_gradients(self.module.parameters(), self.plan,
                                                 self.groups)
        for p in self.module.parameters():
            before = earlier.get(id(p))
            if before is not None:  # in place, as autograd accumulates into .grad
                p.grad = before if p.grad is None else before.add_(p.grad)
        loss = torch.zeros((), device=self.device)
        if losses:
            loss = torch.stack([l.detach().float() for l in losses]).mean()
        if self.groups.pipeline is None:  # world = pp: the last stage's rank
            dist.broadcast(loss, src=self.plan.pp - 1)
        else:
            dist.broadcast(loss, group=self.groups.pipeline, group_src=self.plan.pp - 1)
        loss._memadvisor_pipeline = True
        for stage in self.stages:  # keep nothing alive
            stage.submod.loss_fn = stage.submod.context = None
        kind, where = self.position
        if kind in ("tensor", "loss_fn"):
            return loss
        if kind == "dict":
            keys, key = where
            return {k: (loss if k == key else None) for k in keys}
        length, index = where
        values = [loss if i == index else None for i in range(length)]
        return tuple(values) if kind == "tuple" else values

    def _scale_gradients(self):
        """Each gradient of this rank divided by M once (the mean-loss math of the
        unmodified step), as ``scale_grads=True`` does for one stage."""
        m = self.plan.pipeline_microbatches
        if m != 1:
            for p in self.module.parameters():
                if p.grad is not None:
                    p.grad.div_(m)

    def _sum_replicated_gradients(self):
        """The layers outside the stack: only the first and last stages compute their
        gradients (zero elsewhere); summed over the stages, every rank steps them alike."""
        for p in self.replicated:
            if not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            dist.all_reduce(grad, group=self.groups.pipeline)


def apply_pipeline(module: nn.Module, optimizer: torch.optim.Optimizer, plan: Plan,
                   rank: int, device_type: str, tp_layout=None) -> PipelineModel:
    """Cut ``module`` into this rank's stage (in place) and drop the other stages' parameters
    from ``optimizer``'s groups; returns the model the script calls."""
    blocks = repeated_blocks(checkpointing.module_entries(module))
    if not blocks:
        raise PlanError(f"pp={plan.pp} found no repeated blocks (a ModuleList or Sequential of "
                        "same-class modules) to cut into stages")
    parent = blocks[0].rpartition(".")[0]
    if parent == "" and isinstance(module, nn.Sequential):
        raise PlanError(f"pp={plan.pp}: the repeated blocks are the model's own top-level "
                        "Sequential children; their forward is not a hook point memadvisor "
                        "can cut (wrap the stack in a ModuleList inside a model)")
    ranges = stage_ranges(len(blocks), plan.pipeline_stages)
    place = pipeline_data_parallel.pipeline_rank(plan, rank)
    chunks = ranges[place::plan.pp]  # stages r, r + P, ... (torch's loop-style placement)
    owned = {i for chunk in chunks for i in chunk}
    kept_names = {n for n, _ in module.named_parameters()
                  if not any(n.startswith(b + ".") for i, b in enumerate(blocks)
                             if i not in owned)}
    named = dict(module.named_parameters())
    kept = {id(named[n]) for n in kept_names}
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) in kept]
    device = torch.device(device_type if device_type != "cuda"
                          else f"cuda:{torch.cuda.current_device()}")
    groups = pipeline_data_parallel.make_groups(plan, device_type)
    if device_type == "cpu" and (plan.uses_fsdp or plan.tp > 1):
        # collective buffers freed at one point every run on the groups within a stage; the
        # world and the pipeline's group span stages that run different code: not drained
        gloo_release.exclude(None)
        gloo_release.exclude(groups.pipeline)
        gloo_release.install_drain()
    pipeline_collectives.pipeline_group = groups.pipeline
    pipeline_collectives.data_parallel_group = groups.data_parallel
    pipeline_collectives.tensor_parallel_group = groups.tensor_parallel
    model = PipelineModel(module, plan, place, blocks, chunks, device, groups, optimizer)
    if plan.sp and tp_layout is not None:
        model.sequence = (tp_layout.sequence_cut, tp_layout.sequence_whole)
    return model
