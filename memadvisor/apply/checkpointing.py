"""Activation checkpointing: ``torch.utils.checkpoint`` (non-reentrant) around chosen modules.

Each chosen module's ``forward`` is replaced by one that runs the original under
``checkpoint(..., use_reentrant=False)``: parameter names and the module tree stay as they
were (unlike a wrapper module), and FSDP's hooks, which live on ``__call__``, still run
around it.  Which modules: ``memadvisor.plan.resolve_checkpoint`` (shared with simulate).
"""
from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..plan import ModuleEntry, Plan, resolve_checkpoint


def module_entries(model: nn.Module) -> list[ModuleEntry]:
    return [ModuleEntry(path, type(m).__name__, sum(p.numel() for p in m.parameters()))
            for path, m in model.named_modules()]


def apply_checkpointing(model: nn.Module, plan: Plan, evidence=None) -> list[str]:
    """Wrap the modules the plan selects; returns their paths ('' is the whole model).
    ``evidence`` (checks.Evidence) counts checkpointed calls and the runs of their forwards,
    so the recomputes in backward can be checked before the first step."""
    paths = resolve_checkpoint(plan, module_entries(model))
    modules = dict(model.named_modules())
    for path in paths:
        module = modules[path]
        module.forward = _checkpointed(module.forward, evidence)
    return paths


def _checkpointed(forward, evidence=None):
    def counted(*args, **kwargs):
        if evidence is not None:
            evidence.checkpointed_runs += 1
        return forward(*args, **kwargs)

    @functools.wraps(forward)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():  # evaluation: nothing is saved, nothing to recompute
            return forward(*args, **kwargs)
        if evidence is not None:
            evidence.checkpointed_forwards += 1
        return checkpoint(counted, *args, use_reentrant=False, **kwargs)

    return run
