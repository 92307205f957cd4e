"""The analytic prediction beside the executed one; the executed figure decides.

Both sides are the analysed step's per-rank peak of the worst rank: allocated bytes, and
on a GPU the reserved bytes the caching allocator holds (what must fit).  A difference of
more than ``DISAGREEMENT`` of the executed figure is reported as a disagreement.
"""
from __future__ import annotations

from ..units import format_bytes
from .execute import Verification

#: |analytic - executed| / executed above this is a disagreement worth saying
DISAGREEMENT = 0.02


def compare(prediction, verification: Verification, usable_bytes: int | None = None) -> dict:
    """One JSON-ready record of a verification against ``prediction`` (``usable_bytes``:
    the budget a plan must fit, for ``fits``)."""
    analytic_peak = int(prediction.reserved_bytes or prediction.peak_bytes)
    analytic_allocated = int(prediction.allocated_bytes or prediction.peak_bytes)
    record = verification_dict(verification)
    record.update(analytic_peak_bytes=analytic_peak,
                  analytic_allocated_bytes=analytic_allocated,
                  difference=None, disagrees=None, fits=None)
    worst = verification.worst
    if verification.executed and worst is not None:
        record["difference"] = (analytic_peak - worst.peak_bytes) / max(worst.peak_bytes, 1)
        record["disagrees"] = abs(record["difference"]) > DISAGREEMENT
        if usable_bytes is not None:
            record["fits"] = worst.peak_bytes <= usable_bytes
    return record


def verification_dict(verification: Verification) -> dict:
    worst = verification.worst if verification.executed else None
    return {
        "method": verification.method,
        "where": verification.where,
        "executed": verification.executed,
        "refused": verification.refused,
        "failed": verification.failed,
        "worst_rank": worst.rank if worst else None,
        "executed_peak_bytes": worst.peak_bytes if worst else None,
        "executed_allocated_bytes": worst.peak_allocated_bytes if worst else None,
        "executed_reserved_bytes": worst.peak_reserved_bytes if worst else None,
        "ranks": [{"rank": r.rank, "peak_allocated_bytes": r.peak_allocated_bytes,
                   "peak_reserved_bytes": r.peak_reserved_bytes,
                   "steps_completed": r.steps_completed} for r in verification.ranks],
        "warnings": list(verification.warnings),
        "seconds": round(verification.seconds, 2),
        "waited_seconds": round(verification.waited_s, 2),
    }


def outcome_text(record: dict) -> str:
    """One line: what the execution found, beside the analytic figure."""
    if record["refused"]:
        return f"apply cannot realise it for this script: {record['refused']}"
    if record["failed"]:
        return f"execution failed: {record['failed']}"
    what = "reserved" if record["executed_reserved_bytes"] is not None else "peak"
    text = (f"executed {what} {format_bytes(record['executed_peak_bytes'])} (rank "
            f"{record['worst_rank']}), analytic {format_bytes(record['analytic_peak_bytes'])}"
            f" ({record['difference']:+.1%})")
    if record["disagrees"]:
        text += (f": the analytic model is off by more than {DISAGREEMENT:.0%}; the executed "
                 f"figure stands")
    if record["fits"] is not None:
        text += "; fits" if record["fits"] else "; DOES NOT FIT when executed"
    return text


def verification_lines(record: dict) -> list[str]:
    """The verification block of ``simulate --verify``'s text output."""
    lines = [f"verified by execution ({record['where']}, {record['seconds']:.1f} s):",
             f"  {outcome_text(record)}"]
    if record["executed"]:
        for rank in record["ranks"]:
            reserved = (f", reserved {format_bytes(rank['peak_reserved_bytes'])}"
                        if rank["peak_reserved_bytes"] is not None else "")
            lines.append(f"  rank {rank['rank']}: allocated "
                         f"{format_bytes(rank['peak_allocated_bytes'])}{reserved}")
    lines += [f"  note: {w}" for w in record["warnings"]]
    return lines


def plan_check_text(shown: dict) -> tuple[str, list[str]]:
    """(short mark, notes) for one plan of ``advise``'s table that was checked against the
    script: refused by ``apply``, or executed."""
    if shown.get("apply_refused"):
        return ("apply cannot realise it",
                [f"apply cannot realise it for this script: {shown['apply_refused']}"])
    record = shown.get("verification")
    if not record:
        return "", []
    note = f"{outcome_text(record)} [{record['where']}]"
    if not record["executed"]:
        return ("execution failed" if record["failed"] else "apply cannot realise it"), [note]
    fits = "fits" if record["fits"] else "DOES NOT FIT"
    return (f"executed {format_bytes(record['executed_peak_bytes'])}, "
            f"{record['difference']:+.1%}, {fits}"), [note]
