"""What a rewritten framework script's ``expect_plan`` call says, read from its text
without torch: ``advise`` and ``simulate`` ask it of every plan they check, and importing
torch for it was two seconds of a small trace's ``advise``.  ``probe`` (run time) uses the
same tables.
"""
from __future__ import annotations

import ast
import re

from ...plan import Plan

LABELS = {"hf-trainer": "the HF Trainer", "lightning": "Lightning", "accelerate": "accelerate"}
#: why each framework cannot shard with FSDP on a CPU-only machine (measured with torch
#: 2.13, transformers 5.23, lightning 2.6, accelerate 1.15 under torchrun + gloo)
FSDP_ON_CPU = {
    "hf-trainer": "with use_cpu=True it trains plain DDP, without it TrainingArguments stops "
                  "('Using fsdp only works in distributed training')",
    "lightning": "FSDPStrategy requires a CUDA accelerator",
    "accelerate": "with cpu=True it trains plain DDP, without it nothing is distributed",
}


def _fsdp_needs_cuda(plan: Plan, framework: str) -> str:
    return (f"shard={plan.shard} under {LABELS[framework]} needs CUDA GPUs and this machine "
            f"has none: {FSDP_ON_CPU[framework]}; use shard=ddp here")


def cpu_target_refusal(code: str) -> str | None:
    """For a framework script rewritten for a plan (``code``), why the plan cannot run on a
    CPU-only machine (the framework shards with FSDP only on CUDA), or None: what the
    rewritten script's ``expect_plan`` would stop with there, known before running it."""
    expected = _expected_plan(code)
    if expected is None or not expected[0].uses_fsdp:
        return None
    return _fsdp_needs_cuda(*expected)


_EXPECT = re.compile(r"\.expect_plan\((\"[^\"]*\"), framework=(\"[^\"]*\")\)")


def _expected_plan(text: str) -> tuple[Plan, str] | None:
    """The (plan, framework) a rewritten framework script's ``expect_plan`` call names."""
    match = _EXPECT.search(text)
    if match is None:
        return None
    plan, framework = (ast.literal_eval(group) for group in match.groups())
    return (Plan.parse_spec(plan), framework) if framework in LABELS else None
