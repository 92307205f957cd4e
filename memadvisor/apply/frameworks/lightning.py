"""A plan as Lightning knobs: keywords of the script's ``Trainer(...)`` (``lightning`` or
``pytorch_lightning``) and the training ``DataLoader``'s ``batch_size``.

==================  ==================================================================
plan                Lightning
==================  ==================================================================
amp-bf16 / amp-fp16 ``precision="bf16-mixed"`` / ``"16-mixed"``; bf16: ``"bf16-true"``
accum=K             ``accumulate_grad_batches=K``
world=W             ``devices``/``num_nodes`` = torchrun's ranks per node / nodes
ddp                 ``strategy="ddp"``
zero2/zero3/hybrid  ``strategy=FSDPStrategy(sharding_strategy=...)`` (CUDA only)
checkpoint          a ``Callback`` whose ``setup`` applies torch's checkpoint to the
                    LightningModule's blocks (``memadvisor.apply.checkpointing``)
K*W                 the training ``DataLoader(batch_size=...)`` divided by K*W: Lightning
                    feeds each rank its own batches, one per micro-batch
==================  ==================================================================

The optimizer lives in the user's ``configure_optimizers``: a swap is refused, by name.
"""
from __future__ import annotations

import libcst as cst

from ...plan import Plan
from ..rewrite import RewriteError
from .source import Edits, Script, keyword, literal, source_of, split_batch

NAME = "Lightning"
FRAMEWORK = "lightning"
STRATEGIES = {"zero2": "SHARD_GRAD_OP", "zero3": "FULL_SHARD"}
HYBRID_STRATEGIES = {"zero2": "_HYBRID_SHARD_ZERO2", "zero3": "HYBRID_SHARD"}


def _package(name: str) -> str | None:
    for package in ("lightning.pytorch", "lightning", "pytorch_lightning"):
        if name == package or name.startswith(package + "."):
            return package
    return None


def _is_trainer(name: str) -> bool:
    return _package(name) is not None and name.endswith(".Trainer")


def detect(script: Script) -> bool:
    return bool(script.calls_to(_is_trainer))


def rewrite(script: Script, plan: Plan, alias: str) -> tuple[Edits, dict[str, str]]:
    call = script.the_one_call(_is_trainer, "Lightning Trainer(...)")
    line = script.line(call)
    at = f"{script.filename}:{line}"
    edits = Edits()
    _refuse(script, plan, at)
    package = "lightning.pytorch" if _package(script.qualified(call.func)).startswith(
        "lightning") else "pytorch_lightning"
    if plan.precision != "fp32":
        edits.set(call, "precision", {"amp-bf16": '"bf16-mixed"', "amp-fp16": '"16-mixed"',
                                      "bf16": '"bf16-true"'}[plan.precision])
    if plan.accum > 1:
        existing = keyword(call, "accumulate_grad_batches")
        if existing is not None and literal(existing.value) not in (1, "1"):
            raise RewriteError(f"{at}: Trainer already sets accumulate_grad_batches; the "
                               f"plan's accum={plan.accum} would replace it and change the "
                               "effective batch: remove it from the script first")
        edits.set(call, "accumulate_grad_batches", str(plan.accum))
    if plan.world > 1:
        # torchrun starts the ranks; Lightning checks devices x num_nodes against its world
        edits.set(call, "devices", f"{alias}.ranks_per_node({plan.world})")
        edits.set(call, "num_nodes", f"{alias}.nodes({plan.world})")
        edits.set(call, "strategy", _strategy(plan, package, alias, edits))
    if plan.checkpoint != "none":
        _add_callback(edits, call, f"{alias}.lightning_checkpointing()")
    found = {"configuration": f"Trainer at line {line}"}
    parts = plan.accum * plan.world
    if parts > 1:
        loader = _training_loader(script, at)
        split_batch(edits, loader, "batch_size", parts, None, alias,
                    f"{script.filename}:{script.line(loader)}")
        found["data"] = f"DataLoader at line {script.line(loader)}"
    return edits, found


def _refuse(script: Script, plan: Plan, at: str) -> None:
    if plan.optimizer != "keep":
        hook = next((f for f in script.nodes(cst.FunctionDef)
                     if f.name.value == "configure_optimizers"), None)
        where = f" (line {script.line(hook)})" if hook is not None else ""
        raise RewriteError(f"{at}: optimizer={plan.optimizer}: Lightning builds the optimizer "
                           f"in the LightningModule's configure_optimizers{where}; change it "
                           "there, memadvisor does not edit model code")
    if plan.offload:
        raise RewriteError(f"{at}: offload={'+'.join(sorted(plan.offload))} is not expressed "
                           "through Lightning's Trainer by memadvisor")
    if plan.shard == "zero1":
        raise RewriteError(f"{at}: shard=zero1: Lightning shards optimizer state only through "
                           "DeepSpeed (not configured by memadvisor): use ddp, zero2 or zero3")


def _strategy(plan: Plan, package: str, alias: str, edits: Edits) -> str:
    if not plan.uses_fsdp:
        return '"ddp"'
    edits.header.append(f"from {package}.strategies import FSDPStrategy")
    strategies = HYBRID_STRATEGIES if plan.hybrid else STRATEGIES
    return (f'FSDPStrategy(sharding_strategy="{strategies[plan.shard]}", '
            f"auto_wrap_policy={alias}.repeated_blocks_policy())")


def _add_callback(edits: Edits, call: cst.Call, code: str) -> None:
    existing = keyword(call, "callbacks")
    if existing is None:
        edits.set(call, "callbacks", f"[{code}]")
    elif isinstance(existing.value, cst.List):
        items = [source_of(e.value) for e in existing.value.elements]
        edits.set(call, "callbacks", "[" + ", ".join([*items, code]) + "]")
    else:
        edits.set(call, "callbacks", f"[*({source_of(existing.value)}), {code}]")


def _training_loader(script: Script, at: str) -> cst.Call:
    """The ``DataLoader(...)`` Lightning trains on: the one a ``train_dataloader`` hook
    returns, else the one passed to ``fit``."""
    loaders = [c for c in script.nodes(cst.Call)
               if (source_of(c.func).rpartition(".")[2] == "DataLoader")]
    in_hook = [c for c in loaders
               if (f := script.enclosing(c, cst.FunctionDef)) is not None
               and f.name.value == "train_dataloader"]
    if len(in_hook) == 1:
        return in_hook[0]
    fitted = _fit_loader_names(script)
    assigned = [c for c in loaders if _assigned_name(script, c) in fitted]
    if len(assigned) == 1:
        return assigned[0]
    if len(loaders) == 1:
        return loaders[0]
    raise RewriteError(f"{at}: the plan splits the batch, but memadvisor did not find which "
                       f"DataLoader(...) Lightning trains on ({len(loaders)} found, "
                       f"{len(in_hook)} in a train_dataloader hook)")


def _fit_loader_names(script: Script) -> set[str]:
    names = set()
    for call in script.nodes(cst.Call):
        if isinstance(call.func, cst.Attribute) and call.func.attr.value == "fit":
            args = [a for a in call.args if a.keyword is None][1:2]
            args += [a for a in call.args if a.keyword is not None
                     and a.keyword.value in ("train_dataloaders", "train_dataloader")]
            names |= {source_of(a.value) for a in args}
    return names


def _assigned_name(script: Script, call: cst.Call) -> str | None:
    parent = script.parents.get(call)
    if isinstance(parent, cst.Assign) and len(parent.targets) == 1:
        return source_of(parent.targets[0].target)
    return None
