"""Plans realised in framework scripts with the framework's own knobs.

A script that trains through the HF ``Trainer``, ``lightning.Trainer`` or ``accelerate``
has no loop of its own for ``memadvisor.apply``'s raw-loop rewrite to edit (or has one
whose calls belong to the framework: ``accelerator.backward(loss)``).  Such a script gets
its configuration lines edited instead (``hf_trainer``, ``lightning``, ``accelerate``),
plus two lines after its imports::

    import memadvisor.apply.frameworks as mem
    mem.expect_plan("accum=2", framework="hf-trainer")

``expect_plan`` (``probe``) refuses what this machine cannot run and then checks, at the
first optimizer step, that every knob of the plan took effect, or stops the run.
"""
from __future__ import annotations

import libcst as cst

from ...plan import Plan
from .source import RUNTIME_MODULE, Script, string

#: checked in this order: an HF Trainer script also imports accelerate's machinery
_FRAMEWORKS = ("hf_trainer", "lightning", "accelerate")
ALIASES = ("mem", "memadvisor_plan", "_memadvisor_plan")


def _modules():
    from . import accelerate, hf_trainer, lightning
    return {"hf_trainer": hf_trainer, "lightning": lightning, "accelerate": accelerate}


def detect(module: cst.Module, filename: str = "script.py") -> str | None:
    """The framework the script trains with ('hf-trainer', 'lightning', 'accelerate'), or
    None for a raw loop."""
    script = Script(module, filename)
    if _already_rewritten(script):
        return "rewritten"
    modules = _modules()
    for key in _FRAMEWORKS:
        if modules[key].detect(script):
            return modules[key].FRAMEWORK
    return None


def rewrite(module: cst.Module, source: str, plan: Plan, filename: str):
    """The ``Rewrite`` of a framework script (``detect`` said which), or RewriteError naming
    the knob the framework cannot express and the line."""
    from ..rewrite import Rewrite, RewriteError

    script = Script(module, filename)
    if _already_rewritten(script):
        raise RewriteError(f"{filename} was already rewritten by memadvisor for a framework: "
                           "apply the plan to the original script")
    framework = next(m for m in (_modules()[k] for k in _FRAMEWORKS) if m.detect(script))
    alias = _free_alias(script)
    edits, found = framework.rewrite(script, plan, alias)
    edits.header[:0] = [f"import {RUNTIME_MODULE} as {alias}",
                        f"{alias}.expect_plan({string(str(plan))}, "
                        f"framework={string(framework.FRAMEWORK)})"]
    new = edits.apply(script.module)
    return Rewrite(source, new.code, plan, found={"framework": framework.NAME, **found})


def _already_rewritten(script: Script) -> bool:
    return RUNTIME_MODULE in script.imports.values()


def _free_alias(script: Script) -> str:
    from ..rewrite import RewriteError
    used = {n.value for n in script.nodes(cst.Name)}
    for alias in ALIASES:
        if alias not in used:
            return alias
    raise RewriteError("the script uses every name memadvisor would import its runtime as")


# what a rewritten script calls (``probe``, which imports torch): loaded on first use, so
# that rewriting a script (``advise``, ``simulate`` for every plan they check) needs no torch
_RUN_TIME = frozenset({
    "checkpointed", "expect_plan", "finish", "lightning_checkpointing", "nodes",
    "optimizer_steps", "ranks_per_node", "repeated_blocks_policy", "split_batch",
    "without_cuda"})


def __getattr__(name: str):
    if name in _RUN_TIME:
        from . import probe
        return getattr(probe, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
