"""Activation checkpointing: ``torch.utils.checkpoint`` (non-reentrant) around chosen modules.

Each chosen module's ``forward`` is replaced by one that runs the original under
``checkpoint(..., use_reentrant=False)``: parameter names and the module tree stay as they
were (unlike a wrapper module), and FSDP's hooks, which live on ``__call__``, still run
around it.  Which modules: ``memadvisor.plan.resolve_checkpoint`` (shared with simulate).

A module the script checkpoints itself (``torch.utils.checkpoint`` in its own forward, HF's
``gradient_checkpointing_enable()``, timm's ``set_grad_checkpointing()``) is left as the
script runs it: checkpointing it again inside its own checkpoint would recompute it twice
in the backward and save nothing more.  One line on stderr names the script's line; its calls
and recomputes count as the plan's evidence, since the module is checkpointed.
"""
from __future__ import annotations

import functools
import linecache
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.utils.checkpoint as _torch_checkpoint
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..plan import ModuleEntry, Plan, resolve_checkpoint

_TORCH_CHECKPOINT_FILE = _torch_checkpoint.__file__
_TORCH_FOLDER = str(Path(torch.__file__).parent)


def module_entries(model: nn.Module) -> list[ModuleEntry]:
    return [ModuleEntry(path, type(m).__name__, sum(p.numel() for p in m.parameters()))
            for path, m in model.named_modules()]


@dataclass
class ScriptCheckpoints:
    """Chosen modules found running inside the script's own ``torch.utils.checkpoint``."""
    plan: str = ""
    #: the script's line calling checkpoint -> module paths found under it
    where: dict[str, list[str]] = field(default_factory=dict)

    def found(self, path: str, line: str, class_name: str) -> None:
        paths = self.where.setdefault(line, [])
        if path in paths:
            return
        paths.append(path)
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if len(paths) == 1 and not (distributed and torch.distributed.get_rank() != 0):
            # one line per place the script checkpoints, from the first rank
            print(f"memadvisor: checkpoint={self.plan}: {path or '<model>'} ({class_name}) is "
                  f"already checkpointed by the script at {line}; the modules it checkpoints "
                  "there are left as it runs them (checkpointing them again would recompute "
                  "them twice)", file=sys.stderr, flush=True)


def apply_checkpointing(model: nn.Module, plan: Plan, evidence=None) -> list[str]:
    """Wrap the modules the plan selects; returns their paths ('' is the whole model).
    ``evidence`` (checks.Evidence) counts checkpointed calls and the runs of their forwards,
    so the recomputes in backward can be checked before the first step."""
    paths = resolve_checkpoint(plan, module_entries(model))
    modules = dict(model.named_modules())
    script = ScriptCheckpoints(plan=str(plan.checkpoint if isinstance(plan.checkpoint, str)
                                        else "+".join(plan.checkpoint)))
    for path in paths:
        module = modules[path]
        module.forward = _checkpointed(module.forward, evidence, path, type(module).__name__,
                                       script)
    return paths


def _checkpointed(forward, evidence=None, path: str = "", class_name: str = "",
                  script: ScriptCheckpoints | None = None):
    def counted(*args, **kwargs):
        if evidence is not None:
            evidence.checkpointed_runs += 1
        return forward(*args, **kwargs)

    @functools.wraps(forward)
    def run(*args, **kwargs):
        enclosing = script_checkpoint(sys._getframe(1))
        if enclosing is not None:  # the script checkpoints this module itself
            line, recompute = enclosing
            if script is not None and line:
                script.found(path, line, class_name)
            if evidence is not None:
                evidence.checkpointed_runs += 1
                evidence.checkpointed_forwards += not recompute
            return forward(*args, **kwargs)
        if not torch.is_grad_enabled():  # evaluation: nothing is saved, nothing to recompute
            return forward(*args, **kwargs)
        if evidence is not None:
            evidence.checkpointed_forwards += 1
        return checkpoint(counted, *args, use_reentrant=False, **kwargs)

    return run


def script_checkpoint(frame) -> tuple[str, bool] | None:
    """Whether the code running at ``frame`` runs inside a ``torch.utils.checkpoint`` that
    the script (or a library it uses) started, not memadvisor: ``(line, recompute)`` with
    the line that called ``checkpoint`` ('file:line: `code`'; '' in the recompute, whose caller is
    the autograd engine) and whether this is the recompute in backward; None outside."""
    inside, line = False, ""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "counted" and frame.f_globals.get("__name__") == __name__:
            return None  # memadvisor's own checkpoint (a module inside a chosen one)
        if code.co_filename == _TORCH_CHECKPOINT_FILE:
            inside = True
            if code.co_name in ("checkpoint", "checkpoint_sequential"):
                line = _caller_line(frame.f_back)
        frame = frame.f_back
    if not inside:
        return None
    return line, not line


def _caller_line(frame) -> str:
    """'file:line' of the first frame outside torch (the script's, or a library's)."""
    while frame is not None and frame.f_code.co_filename.startswith(_TORCH_FOLDER):
        frame = frame.f_back
    if frame is None:
        return "?"
    code = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    where = f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"
    return f"{where}: `{code[:90]}`" if code else where
