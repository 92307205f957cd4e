"""Predictions as JSON-ready dicts and as text tables (formatting only, no printing)."""
from __future__ import annotations

from ..units import format_bytes
from . import explain
from .hardware import Hardware
from .search import SearchResult
from .simulator import Baseline, Prediction


def prediction_dict(base: Baseline, prediction: Prediction, hw: Hardware) -> dict:
    plan = prediction.plan
    cost = prediction.cost
    return {
        "plan": plan.to_dict(),
        "plan_compact": plan.to_compact(),
        "peak_bytes": prediction.peak_bytes,
        "allocated_bytes": prediction.allocated_bytes,
        "reserved_bytes": prediction.reserved_bytes,
        "by_category": prediction.by_category,
        "micro_batch_size": prediction.micro_batch_size,
        "step_time_factor": round(cost.step_time_factor, 4),
        "step_time_s": cost.step_time_s,
        "baseline_step_time_s": cost.baseline_step_s,
        "cost_terms": [{"what": what, "seconds": seconds} for what, seconds in cost.terms],
        "assumptions": cost.assumptions,
        "host_bytes": {k: int(v) for k, v in prediction.host_bytes.items()},
        "checkpointed_modules": prediction.regions,
        "terms": explain.category_terms(base.peak.by_category, prediction.by_category, plan,
                                        prediction.micro_batch_size, base.batch_size),
        "why_little": explain.small_saving_reasons(
            base.peak.by_category, prediction.peak_bytes, base.peak.bytes, plan,
            predicted=prediction.by_category or None),
        "changes": explain.changes(plan),
        "out_of_memory": prediction.out_of_memory,
        "per_rank": plan.world > 1,
        "hardware": hw.name,
        #: gloo (CPU) zero2/zero3 and tp plans: the peak when what a collective used is
        #: freed as the collective returns -- what ``apply``'s runs measure (it drains
        #: gloo's worker thread, apply/gloo_release.py)
        "peak_bytes_if_collectives_free_at_once": prediction.notes.get(
            "peak_bytes_if_collectives_free_at_once"),
        #: pp: every stage's peak and its terms (pipeline_parallel.py); the peak is the worst
        "pipeline_stages": prediction.notes.get("pipeline_parallel", {}).get("stages"),
    }


def baseline_on_target(base: Baseline, hw: Hardware) -> int:
    """The unmodified script's peak on ``hw``: the recorded peak where the trace was
    recorded on that kind of device, else the identity plan simulated on it (a CPU trace on
    a GPU target gains what only the GPU allocates, e.g. cuBLAS's workspaces)."""
    if hw.device_type == base.device_type:
        return base.peak.bytes
    from ..plan import Plan
    from .simulator import simulate
    return simulate(base, Plan(), hw, run_allocator=False, categories=False).peak_bytes


def simulate_dict(base: Baseline, prediction: Prediction, hw: Hardware) -> dict:
    out = prediction_dict(base, prediction, hw)
    out["baseline_peak_bytes"] = baseline_on_target(base, hw)
    out["recorded_peak_bytes"] = base.peak.bytes
    out["baseline_by_category"] = base.peak.by_category
    out["warnings"] = base.warnings
    out["hardware_description"] = hw.describe()
    return out


def simulate_text(data: dict) -> str:
    lines = [f"plan: {data['plan_compact']}   (target {data['hardware_description']})"]
    per = " per rank" if data["per_rank"] else ""
    lines.append(f"peak{per}: {format_bytes(data['peak_bytes'])}   baseline "
                 f"{format_bytes(data['baseline_peak_bytes'])}")
    lines += [f"  {_stage_text(stage)} ({stage['peak_bytes']:,} B)"
              for stage in data.get("pipeline_stages") or ()]
    if data.get("peak_bytes_if_collectives_free_at_once") is not None:
        lines.append(f"  (memadvisor apply frees gloo's collective buffers as each collective "
                     f"returns: its runs peak at "
                     f"{format_bytes(data['peak_bytes_if_collectives_free_at_once'])}; the peak "
                     f"above also holds where gloo's worker thread frees them late, on a "
                     f"process group the script made itself)")
    if data["reserved_bytes"] is not None and data["reserved_bytes"] != data["peak_bytes"]:
        lines.append(f"allocator: allocated {format_bytes(data['allocated_bytes'])}, "
                     f"reserved {format_bytes(data['reserved_bytes'])}")
    lines.append(f"step time: x{data['step_time_factor']:.3f} of the baseline step")
    lines.append("")
    lines.append("at the peak:")
    lines += [f"  {term}" for term in data["terms"]]
    if data["why_little"]:
        lines.append("")
        lines.append("why it saves little:")
        lines += [f"  {reason}" for reason in data["why_little"]]
    lines.append("")
    lines.append("step time terms:")
    lines += [f"  {t['seconds'] * 1e3:+.2f} ms  {t['what']}" for t in data["cost_terms"]] or [
        "  none"]
    lines.append("assumptions: " + "; ".join(data["assumptions"]))
    if data["host_bytes"]:
        lines.append("host memory: " + ", ".join(
            f"{k.replace('_', ' ')} {format_bytes(v)}" for k, v in data["host_bytes"].items()))
    lines.append("changes: " + "; ".join(data["changes"]))
    lines += [f"warning: {w}" for w in data["warnings"]]
    return "\n".join(lines)


def _stage_text(stage: dict) -> str:
    """'stage 0 (blocks 0-1, 2 in flight): 1.2 GiB' (``pipeline_parallel.stage_peaks``);
    under interleaved a rank's stages each with its blocks: 'rank 0 (stages 0: blocks 0-1,
    2: blocks 4-5; 3 in flight at the peak): ...'."""
    if "stages" in stage:
        held = ", ".join(f"{g}: blocks {_span(*blocks)}"
                         for g, blocks in zip(stage["stages"], stage["stage_blocks"]))
        return (f"rank {stage['stage']} (stages {held}; {stage['in_flight_micro_batches']} in "
                f"flight at the peak): {format_bytes(stage['peak_bytes'])}")
    return (f"stage {stage['stage']} (blocks {_span(*stage['blocks'])}, "
            f"{stage['in_flight_micro_batches']} in flight): {format_bytes(stage['peak_bytes'])}")


def _span(first: int, last: int) -> str:
    return f"{first}-{last}" if last > first else f"{first}"


def _worst_stage_lines(stages) -> list[str]:
    """What a pp plan's terms (its worst stage's one micro-step) leave out of its peak."""
    if not stages:
        return []
    worst = max(stages, key=lambda stage: stage["peak_bytes"])
    return [f"  (the terms are stage {worst['stage']}'s one micro-step, "
            f"{format_bytes(worst['one_micro_batch_bytes'])}; its peak "
            f"{format_bytes(worst['peak_bytes'])} also holds "
            f"{worst['in_flight_micro_batches']} micro-batches in flight "
            f"({format_bytes(worst['saved_activation_bytes'])} of saved activations each) "
            f"and {format_bytes(worst['p2p_buffer_bytes'])} of point-to-point buffers)"]


def advise_dict(base: Baseline, result: SearchResult, hw: Hardware) -> dict:
    return {
        "budget_bytes": result.budget_bytes,
        "usable_bytes": result.usable_bytes,
        "hardware": hw.describe(),
        "baseline_peak_bytes": baseline_on_target(base, hw),
        "recorded_peak_bytes": base.peak.bytes,
        "evaluated": result.evaluated,
        "rejected": len(result.rejected),
        "not_proposed": script_refusals(result.rejected),
        "over_budget": len(result.too_big),
        "plans": [prediction_dict(base, p, hw) for p in result.ranked],
        "max_micro_batch": result.max_micro_batch,
        "warnings": base.warnings,
    }


def script_refusals(rejected) -> dict[str, int]:
    """The reasons the script's own code gives to leave plans out (a loss coupling the
    batch's samples, an op refusing mixed dtypes, a batch of samples of different sizes
    concatenated), each with how many plans it took."""
    from .batch_coupling import SPLIT_REFUSAL
    from .inplace_dtypes import REFUSAL_MARK
    from .ragged_batch import RAGGED
    out: dict[str, int] = {}
    for _, why in rejected:
        if why.startswith((SPLIT_REFUSAL, RAGGED)) or REFUSAL_MARK in why:
            out[why] = out.get(why, 0) + 1
    return out


def advise_text(data: dict) -> str:
    lines = [f"target: {data['hardware']}",
             f"budget {format_bytes(data['budget_bytes'])} per GPU, usable "
             f"{format_bytes(data['usable_bytes'])}; baseline peak "
             f"{format_bytes(data['baseline_peak_bytes'])}",
             f"{data['evaluated']} plans: {len(data['plans'])} shown, "
             f"{data['over_budget']} over budget, {data['rejected']} cannot run here"]
    lines += [f"not proposed ({count} plans): {why}"
              for why, count in data.get("not_proposed", {}).items()]
    verification = data.get("verification")  # how the fits were decided (the command's)
    if verification is not None:
        lines.append(verification["text"])
    lines.append("")
    header = f"{'#':>2}  {'peak':>10}  {'reserved':>10}  {'time':>7}  {'GPU-time':>8}  plan"
    lines.append(header)
    notes = []
    for index, plan in enumerate(data["plans"], 1):
        stages = plan.get("pipeline_stages") or ()
        # a pp plan's reserved figure is its worst stage's peak: no allocator model per stage
        reserved = (format_bytes(plan["reserved_bytes"])
                    if plan["reserved_bytes"] and not stages else "-")
        mark = plan.get("check_mark")  # filled by the command that checked the plans
        lines.append(f"{index:>2}  {format_bytes(plan['peak_bytes']):>10}  {reserved:>10}  "
                     f"x{plan['step_time_factor']:<6.3f}  "
                     f"x{plan['step_time_factor'] * plan['plan']['world']:<7.3f}  "
                     f"{plan['plan_compact']}"
                     + (f"   [{mark}]" if mark else ""))
        lines += [f"{'':>4}{_stage_text(stage)}" for stage in stages]
        notes += [f"#{index}: {note}" for note in plan.get("check_notes", [])]
    if notes:
        lines += ["", *notes]
    said = verification is not None and "checked against `apply`" in verification["text"]
    if not said and data.get("apply_checked") is False and data["plans"]:
        lines += ["", "note: the profiled script was not found, so no plan was checked "
                      "against what `apply` can rewrite"]
    baseline = data.get("baseline_verification")  # its peak on the target, executed
    executed_baseline = baseline is not None and baseline.get("executed")
    if executed_baseline and not baseline["fits"]:
        lines += ["", f"the unmodified script executed: peak "
                      f"{format_bytes(baseline['executed_peak_bytes'])}, DOES NOT FIT "
                      f"(analytic {format_bytes(data['baseline_peak_bytes'])}) "
                      f"[{baseline['where']}]"]
    best_index = data.get("best", 0 if data["plans"] else None)
    if data.get("keep_as_is"):
        peak = (f"{format_bytes(baseline['executed_peak_bytes'])} executed (analytic "
                f"{format_bytes(data['baseline_peak_bytes'])})" if executed_baseline else
                format_bytes(data["baseline_peak_bytes"]))
        lines += ["", f"best: change nothing -- the unmodified script's peak "
                      f"{peak} fits the usable "
                      f"{format_bytes(data['usable_bytes'])}; the plans above (ranked by "
                      f"GPU-time) would still change it: pick one with --objective "
                      f"cost|speed|memory"]
        best_index = None
    elif data.get("objective"):
        lines += ["", {"cost": "ranked by GPU-time per step (step time x GPUs)",
                       "speed": "ranked by wall time per step (more GPUs count as free)",
                       "memory": "ranked by peak memory"}[data["objective"]]]
    if best_index is not None:
        best = data["plans"][best_index]
        lines += ["", f"best: {best['plan_compact']}"]
        lines += [f"  {term}" for term in best["terms"]]
        lines += _worst_stage_lines(best.get("pipeline_stages"))
        lines.append("  changes: " + "; ".join(best["changes"]))
    if any(plan.get("pipeline_stages") for plan in data["plans"]):
        lines += ["", "pp plans: the peak is the worst stage's (each stage's below its plan); "
                      "no allocator model per stage (reserved '-': the fit is the peak's)"]
    if data["max_micro_batch"]:
        lines.append("")
        lines.append("largest micro-batch per rank that fits (analytic: not executed):")
        lines += [f"  {n:>6}  {plan}" for plan, n in data["max_micro_batch"].items()]
    lines += [f"warning: {w}" for w in data["warnings"]]
    return "\n".join(lines)

