"""A plan as accelerate knobs: keywords of the script's ``Accelerator(...)``, the training
``DataLoader``'s ``batch_size`` and, for accumulation, ``with accelerator.accumulate(model):``.

==================  ==================================================================
plan                accelerate
==================  ==================================================================
amp-bf16 / amp-fp16 ``mixed_precision="bf16"`` / ``"fp16"``
accum=K             ``gradient_accumulation_steps=K``; the loop body inside
                    ``with accelerator.accumulate(model):`` (added when missing); the
                    DataLoader's batch_size / K; ``len(loader)`` used to size a schedule
                    becomes optimizer steps (``optimizer_steps(len(loader), accum=K)``)
world=W             ``dataloader_config=DataLoaderConfiguration(split_batches=True)``: the
                    loader's batch is the global batch, each rank takes its slice
zero2 / zero3       ``fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, ...)``
                    (CUDA only); checkpointing then through the plugin
checkpoint          ``accelerator.prepare(checkpointed(model), ...)``: torch's checkpoint
                    around the plan's blocks before accelerate wraps the model
ddp                 torchrun's environment makes ``prepare`` wrap in DDP; on a machine
                    without CUDA only with ``cpu=True``: ``cpu=<no CUDA here>``
                    (``source.cpu_switch``)
==================  ==================================================================

The script's own ``accelerator.backward(loss)`` and ``optimizer.step()`` stay as they are:
accelerate scales, syncs and skips steps itself.
"""
from __future__ import annotations

import libcst as cst

from ...plan import Plan
from ..rewrite import RewriteError
from .source import Edits, Script, cpu_switch, keyword, source_of, split_batch

NAME = "accelerate"
FRAMEWORK = "accelerate"


def _is_accelerator(name: str) -> bool:
    return name in ("accelerate.Accelerator", "accelerate.accelerator.Accelerator")


def detect(script: Script) -> bool:
    return bool(script.calls_to(_is_accelerator))


def rewrite(script: Script, plan: Plan, alias: str) -> tuple[Edits, dict[str, str]]:
    call = script.the_one_call(_is_accelerator, "Accelerator(...)")
    at = f"{script.filename}:{script.line(call)}"
    accelerator = _assigned_name(script, call)
    if accelerator is None:
        raise RewriteError(f"{at}: Accelerator(...) is not assigned to a name")
    _refuse(script, plan, at)
    edits = Edits()
    if plan.precision != "fp32":
        edits.set(call, "mixed_precision", {"amp-bf16": '"bf16"', "amp-fp16": '"fp16"'}[
            plan.precision])
    switch = cpu_switch(call, "cpu", alias)
    if plan.world > 1 and not plan.uses_fsdp and switch is not None:
        edits.set(call, "cpu", switch)  # without CUDA accelerate distributes only with it
    if plan.world > 1:
        if keyword(call, "dataloader_config") is not None:
            raise RewriteError(f"{at}: Accelerator(dataloader_config=...) is the script's own; "
                               "the plan needs split_batches=True in it: set it there")
        if keyword(call, "split_batches") is not None:
            edits.set(call, "split_batches", "True")
        else:
            edits.header.append("from accelerate import DataLoaderConfiguration")
            edits.set(call, "dataloader_config", "DataLoaderConfiguration(split_batches=True)")
    if plan.uses_fsdp:
        edits.header.append("from accelerate import FullyShardedDataParallelPlugin")
        options = [f"fsdp_version=2",
                   f"reshard_after_forward={plan.shard == 'zero3'}"]
        if plan.checkpoint == "auto":
            options.append("activation_checkpointing=True")
        edits.set(call, "fsdp_plugin", f"FullyShardedDataParallelPlugin({', '.join(options)})")
    found = {"configuration": f"Accelerator at line {script.line(call)}"}
    if plan.checkpoint != "none" and not plan.uses_fsdp:
        found["checkpointing"] = _checkpoint_model(script, edits, accelerator, alias, at)
    if plan.accum > 1:
        loop, backward = _training_loop(script, accelerator, at)
        edits.set(call, "gradient_accumulation_steps", str(plan.accum))
        found["loop"] = f"line {script.line(loop)}"
        if not _inside_accumulate(script, backward, loop, accelerator):
            model = _model_name(script, loop, accelerator, at)
            _wrap_in_accumulate(edits, loop, accelerator, model)
        loader = _loader_of(script, loop, at)
        split_batch(edits, loader, "batch_size", plan.accum, None, alias,
                    f"{script.filename}:{script.line(loader)}")
        found["data"] = f"DataLoader at line {script.line(loader)}"
        for length in _lengths_outside(script, source_of(loop.iter), loop):
            edits.nodes[id(length)] = lambda updated, k=plan.accum: cst.parse_expression(
                f"{alias}.optimizer_steps({source_of(updated)}, accum={k})")
    return edits, found


def _refuse(script: Script, plan: Plan, at: str) -> None:
    if plan.precision == "bf16":
        raise RewriteError(f"{at}: precision=bf16 (parameters stored in bfloat16): accelerate's "
                           "mixed_precision is autocast; use precision=amp-bf16")
    if plan.checkpoint not in ("none", "auto") and plan.uses_fsdp:
        raise RewriteError(f"{at}: {Plan(checkpoint=plan.checkpoint)} with "
                           f"shard={plan.shard}: accelerate's FSDP plugin checkpoints every "
                           "wrapped block (activation_checkpointing=True): use checkpoint=auto")
    if plan.optimizer != "keep":
        raise RewriteError(f"{at}: optimizer={plan.optimizer}: the script builds its own "
                           "optimizer and accelerate wraps it; change it in the script")
    if plan.shard == "zero1" or plan.hybrid is not None or plan.offload:
        what = ("shard=zero1" if plan.shard == "zero1" else
                f"hybrid={plan.hybrid}" if plan.hybrid is not None else
                f"offload={'+'.join(sorted(plan.offload))}")
        raise RewriteError(f"{at}: {what} is not expressed through Accelerator(...) by "
                           "memadvisor: use ddp, zero2 or zero3")


def _checkpoint_model(script: Script, edits: Edits, accelerator: str, alias: str,
                      at: str) -> str:
    """Accelerator has no checkpointing knob outside FSDP: the model handed to ``prepare``
    goes through ``checkpointed`` (torch's checkpoint around the plan's blocks, as
    ``memadvisor.apply.checkpointing`` does for raw loops) before accelerate wraps it."""
    loop, _ = _training_loop(script, accelerator, at)
    model = _model_name(script, loop, accelerator, at)
    for call in script.nodes(cst.Call):
        if source_of(call.func) != f"{accelerator}.prepare":
            continue
        for arg in call.args:
            if arg.keyword is None and source_of(arg.value) == model:
                edits.nodes[id(arg.value)] = lambda updated: cst.parse_expression(
                    f"{alias}.checkpointed({source_of(updated)})")
                return f"{model} at line {script.line(call)}"
    raise RewriteError(f"{at}: checkpointing: {model} is not passed to {accelerator}.prepare(...)")


def _assigned_name(script: Script, call: cst.Call) -> str | None:
    parent = script.parents.get(call)
    if isinstance(parent, cst.Assign) and len(parent.targets) == 1:
        return source_of(parent.targets[0].target)
    return None


def _training_loop(script: Script, accelerator: str, at: str):
    backwards = [c for c in script.nodes(cst.Call)
                 if source_of(c.func) == f"{accelerator}.backward"]
    if len(backwards) != 1:
        raise RewriteError(f"{at}: accum needs the one {accelerator}.backward(loss) of the "
                           f"training loop; found {len(backwards)}")
    loop = script.enclosing(backwards[0], cst.For)
    if loop is None:
        raise RewriteError(f"{at}: {accelerator}.backward(loss) (line "
                           f"{script.line(backwards[0])}) is not inside a for loop over batches")
    return loop, backwards[0]


def _inside_accumulate(script: Script, node, loop, accelerator: str) -> bool:
    parent = script.parents.get(node)
    while parent is not None and parent is not loop:
        if isinstance(parent, cst.With) and any(
                isinstance(i.item, cst.Call) and source_of(i.item.func) ==
                f"{accelerator}.accumulate" for i in parent.items):
            return True
        parent = script.parents.get(parent)
    return False


def _model_name(script: Script, loop, accelerator: str, at: str) -> str:
    """The prepared model: a name ``accelerator.prepare(...)`` returns that the loop calls."""
    prepared = set()
    for assign in script.nodes(cst.Assign):
        if isinstance(assign.value, cst.Call) and source_of(assign.value.func) == \
                f"{accelerator}.prepare":
            for target in assign.targets:
                node = target.target
                elements = node.elements if isinstance(node, (cst.Tuple, cst.List)) else [node]
                prepared |= {source_of(getattr(e, "value", e)) for e in elements}
    called = []
    for call in script.nodes(cst.Call):
        if source_of(call.func) in prepared and _within(script, call, loop):
            called.append(source_of(call.func))
    if len(set(called)) != 1:
        raise RewriteError(f"{at}: accum needs `with {accelerator}.accumulate(model):` around the "
                           "step, and memadvisor did not find which prepared object is the "
                           "model; add that line yourself")
    return called[0]


def _within(script: Script, node, ancestor) -> bool:
    parent = script.parents.get(node)
    while parent is not None:
        if parent is ancestor:
            return True
        parent = script.parents.get(parent)
    return False


def _wrap_in_accumulate(edits: Edits, loop: cst.For, accelerator: str, model: str) -> None:
    def wrap(updated: cst.For) -> cst.For:
        with_statement = cst.parse_statement(f"with {accelerator}.accumulate({model}):\n    pass\n")
        inner = with_statement.body.with_changes(body=updated.body.body)
        return updated.with_changes(body=updated.body.with_changes(
            body=[with_statement.with_changes(body=inner)]))
    edits.nodes[id(loop)] = wrap


def _loader_of(script: Script, loop: cst.For, at: str) -> cst.Call:
    name = source_of(loop.iter)
    loaders = [c for c in script.nodes(cst.Call)
               if source_of(c.func).rpartition(".")[2] == "DataLoader"
               and _assigned_name(script, c) == name]
    if len(loaders) != 1:
        raise RewriteError(f"{at}: accum splits the batch, but memadvisor did not find the "
                           f"`{name} = DataLoader(...)` the loop (line {script.line(loop)}) "
                           "iterates")
    return loaders[0]


def _lengths_outside(script: Script, name: str, loop) -> list[cst.Call]:
    """``len(loader)`` outside the loop: a schedule sized in batches, which become
    micro-batches once the loader's batch is split."""
    return [c for c in script.nodes(cst.Call)
            if source_of(c.func) == "len" and len(c.args) == 1
            and source_of(c.args[0].value) == name and not _within(script, c, loop)]

