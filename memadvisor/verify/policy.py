"""Whether ``advise`` verifies its plans by executing them, and what its output says when not.

On a GPU target verification is fake execution on the simulated GPU: no memory, no GPU,
seconds to minutes per plan; and there the analytic model is known to miss (a real H100,
docs/GPU_TRUTH.md: plans under-predicted by up to 36.5%, far past ``advise``'s 5% margin,
where fake execution was within 2% in 80 of 89 runs).  So ``advise`` executes its top
``DEFAULT_GPU_PLANS`` there unless told ``--verify 0``.  On the CPU target verification is
the real run at the recorded size, one plan after another: slow, so off unless asked.  Where
the script the trace recorded cannot be found, nothing runs and the output says so.
"""
from __future__ import annotations

from dataclasses import dataclass

#: plans ``advise`` executes on a GPU target when ``--verify`` is not given
DEFAULT_GPU_PLANS = 5

#: the analytic model against a real H100 (docs/GPU_TRUTH.md, "A real H100", 58 plan runs:
#: peak allocated median |error| 1.68%, worst -36.51% (a ResNet, offload=activations))
GPU_ANALYTIC_WORST_UNDER = 0.3651
GPU_ANALYTIC_MEDIAN = 0.0168
#: the analytic model against real CPU runs over the script zoo (docs/ACCURACY.md, 159
#: measured cases: the worst under-prediction -4.80%, dcgan precision=bf16)
CPU_ANALYTIC_WORST_UNDER = 0.048


@dataclass(frozen=True, slots=True)
class VerifyChoice:
    """How many plans ``advise`` executes, and why none where it executes none."""

    count: int  #: plans to execute (0: the fits are analytic)
    default: bool  #: ``--verify`` was not given: the count is this module's choice
    unverified_reason: str | None = None  #: one clause, where ``count`` is 0
    script_missing: bool = False  #: the recorded script cannot be run again


def choose(asked: int | None, device_type: str, script_problem: str | None) -> VerifyChoice:
    """``asked``: ``--verify``'s value (None: not given); ``script_problem``: why the
    recorded script cannot be run again (None: it can).  An explicit ``--verify K`` with the
    script missing is the caller's error to raise; here it is only described."""
    missing = script_problem is not None
    if asked is not None:
        if asked == 0:
            return VerifyChoice(0, False, "--verify 0", missing)
        return VerifyChoice(asked, False, script_problem, missing)
    if missing:
        return VerifyChoice(0, True, script_problem, True)
    if device_type == "cuda":
        return VerifyChoice(DEFAULT_GPU_PLANS, True)
    return VerifyChoice(0, True, "the cpu target is verified only when asked")


def summary_dict(choice: VerifyChoice, device_type: str, executed: int, attempted: int,
                 method: str | None, where: str | None, failed_reason: str | None = None,
                 recorded: bool = False, baseline: bool = False) -> dict:
    """``advise --json``'s ``verification`` field: whether the fits shown were decided by
    executing plans, how, and why not.  ``recorded``: nothing is declared to fit but the
    unmodified script, by the peak its trace recorded on the target's kind of device;
    ``baseline``: nothing but the unmodified script is declared to fit (executed or not)."""
    decided = "execution" if executed else "recorded" if recorded else "analytic"
    reason = None if recorded else choice.unverified_reason
    if attempted and not executed:
        what = "the unmodified script" if baseline else "no plan"
        reason = (f"{what} could {'not ' if baseline else ''}be executed"
                  + (f": {failed_reason}" if failed_reason else ""))
    return {
        "fits_decided_by": decided,
        "subject": "the unmodified script" if baseline else "plans",
        "method": method if executed else None,  # 'fake' (simulated GPU) or 'real' (CPU)
        "where": where if executed else None,
        "default": choice.default,
        "plans_requested": choice.count,
        "plans_attempted": attempted,
        "plans_executed": executed,
        "unverified_reason": None if executed else reason,
        "script_missing": choice.script_missing,
        "known_analytic_miss": None if executed or recorded else known_miss(device_type),
    }


def known_miss(device_type: str) -> dict:
    """How far the analytic model is known to have under-predicted on this kind of target."""
    if device_type == "cuda":
        return {"worst_under": GPU_ANALYTIC_WORST_UNDER, "median": GPU_ANALYTIC_MEDIAN,
                "source": "docs/GPU_TRUTH.md"}
    return {"worst_under": CPU_ANALYTIC_WORST_UNDER, "source": "docs/ACCURACY.md"}


def fits_line(summary: dict, device_type: str) -> str:
    """One line for ``advise``'s text output: how the fits shown were decided."""
    if summary["fits_decided_by"] == "recorded":
        return ("fits: the unmodified script's peak as its trace recorded it on this kind of "
                "device; no plan needed executing")
    if summary["fits_decided_by"] == "execution" and summary["subject"] == "plans":
        first = "" if summary["plans_executed"] == summary["plans_attempted"] else \
            f" of {summary['plans_attempted']}"
        return (f"fits: verified by execution where marked -- {summary['plans_executed']}"
                f"{first} plan{'s' if summary['plans_attempted'] != 1 else ''} ran "
                f"({summary['where']}); the executed figure decides (docs/VERIFY.md)")
    if summary["fits_decided_by"] == "execution":
        return (f"fits: verified by execution -- the unmodified script ran "
                f"({summary['where']}); the executed figure decides (docs/VERIFY.md)")
    reason = summary["unverified_reason"] or ""
    if device_type == "cuda":
        miss = (f"on a real H100 the analytic model under-predicted plans' peaks by up to "
                f"{GPU_ANALYTIC_WORST_UNDER:.1%} (docs/GPU_TRUTH.md)")
        if reason == "--verify 0":
            return (f"fits: analytic, UNVERIFIED (--verify 0) -- {miss}; without --verify 0 "
                    f"the top {DEFAULT_GPU_PLANS} are executed on the simulated GPU")
        if summary["script_missing"]:
            return (f"fits: analytic, UNVERIFIED -- {reason}, so no plan was executed or "
                    f"checked against `apply`; {miss}")
        return f"fits: analytic, UNVERIFIED -- {reason}; {miss}"
    miss = (f"over the script zoo the analytic peak was up to {CPU_ANALYTIC_WORST_UNDER:.1%} "
            f"under the real run's (docs/ACCURACY.md)")
    if summary["script_missing"] and reason != "--verify 0":
        return (f"fits: analytic, unverified -- {reason}, so no plan was executed or checked "
                f"against `apply`; {miss}")
    if summary["unverified_reason"] and summary["plans_attempted"]:
        return f"fits: analytic, UNVERIFIED -- {reason}; {miss}"
    return (f"fits: analytic, unverified -- `--verify K` runs the top K plans for real on "
            f"this CPU (slow: each runs its steps at the recorded size); {miss}")


def report_note(device_type: str) -> str:
    """What ``report``'s plan section says of its figures: analytic, never executed (a report
    stays fast); ``advise`` is where plans are executed."""
    if device_type == "cuda":
        return (f"Analytic predictions: no plan was executed. On a real H100 the analytic "
                f"model under-predicted plans' peaks by up to {GPU_ANALYTIC_WORST_UNDER:.1%} "
                f"(docs/GPU_TRUTH.md); `memadvisor advise TRACE --budget SIZE` executes the "
                f"top {DEFAULT_GPU_PLANS} on a simulated GPU before it calls one a fit.")
    return (f"Analytic predictions: no plan was executed. Over the script zoo the analytic "
            f"peak was up to {CPU_ANALYTIC_WORST_UNDER:.1%} under the real run's "
            f"(docs/ACCURACY.md); `memadvisor advise TRACE --budget SIZE --verify K` runs the "
            f"top K for real on this CPU.")
