"""Verify a plan by executing it: ``simulate --verify`` and ``advise --verify K``.

``script``: the script a trace recorded and apply's rewrite of it; ``execute``: running the
rewritten script (fake tensors on a simulated GPU, or for real on this CPU) and measuring
its peaks; ``compare``: the analytic prediction beside the executed one.  Depends on
``apply``, ``profile`` (through the fake-execution child) and ``simulate``; nothing
depends on it but the commands.
"""
from .compare import DISAGREEMENT, compare, verification_dict
from .execute import RankPeaks, Verification, ranks_to_run, verify_plan
from .script import RecordedScript, apply_refusals, baseline_as_applied, recorded_script

__all__ = ["DISAGREEMENT", "RankPeaks", "RecordedScript", "Verification", "apply_refusals",
           "compare", "ranks_to_run", "recorded_script", "verification_dict", "verify_plan"]
