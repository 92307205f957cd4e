"""`memadvisor advise TRACE --budget 24GiB [--gpus 8] [--gpu h100-80gb] [--json] [--save-plan F]`"""
from __future__ import annotations

import json
import os

import click

from ..terminal import safe_text
from .simulate import verify_depth_option


@click.command()
@click.argument("trace_path", metavar="TRACE")
@click.option("--budget", required=True, help="Memory per GPU, e.g. 24GiB or 80GB.")
@click.option("--gpus", default=1, show_default=True, type=click.IntRange(min=1),
              help="GPUs (ranks) available.")
@click.option("--gpu", default=None, help="Target hardware profile, e.g. h100-80gb "
              "(default: the device that recorded the trace).")
@click.option("--margin", default=0.05, show_default=True, type=float,
              help="Safety margin: plans must fit in budget x (1 - margin).")
@click.option("--allow", default="", help="Also propose plans that change training "
              "semantics: bf16, optimizer (comma-separated).")
@click.option("--top", default=10, show_default=True, type=click.IntRange(min=1))
@click.option("--expandable-segments", is_flag=True,
              help="Model PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.")
@click.option("--save-plan", default=None, help="Write the best plan as JSON for `apply`.")
@click.option("--overwrite", is_flag=True, help="Let --save-plan replace an existing file.")
@click.option("--verify", "verify_count", type=click.IntRange(min=0), is_flag=False,
              flag_value=5, default=None, metavar="[K]",
              help="Execute the top K plans (--verify alone: 5) as `apply` would run them -- "
                   "fake tensors on the simulated GPU, or for real on this CPU for the cpu "
                   "target -- and keep only plans whose executed peak fits.  Default: 5 on a "
                   "GPU target where the profiled script is found, 0 on the cpu target (a real "
                   "run per plan); --verify 0: analytic fits only.")
@verify_depth_option
@click.option("--objective", type=click.Choice(["cost", "speed", "memory"]), default=None,
              help="What 'best' means: cost (GPU-time per step: a GPU that halves the step "
                   "costs as much; the default), speed (wall time per step: GPUs are free) or "
                   "memory (the smallest peak).  Without it, a script that already fits is "
                   "told to change nothing.")
@click.option("--compile", "compile_model", is_flag=True,
              help="Also predict what torch.compile would save (runs the profiled script "
                   "again on fake CPU tensors through inductor's partitioner: seconds to "
                   "tens of seconds; docs/COMPILE_ADVICE.md).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object with stable keys.")
def command(trace_path, budget, gpus, gpu, margin, allow, top, expandable_segments, save_plan,
            overwrite, verify_count, verify_depth, objective, compile_model, as_json):
    """Rank every plan that fits a memory budget by predicted step time.  Plans `apply`
    cannot realise for the profiled script are marked; the top plans are executed (by
    default on a GPU target, with --verify K on the cpu target) and the executed peak
    decides whether they fit."""
    from ..errors import UserError
    from ..plan import Plan
    from ..trace.io import read_trace
    from ..units import format_bytes, parse_bytes
    from ..simulate import advise
    from ..verify import baseline_as_applied
    from ..simulate.output import advise_dict, advise_text
    from ..advice import advice_dicts, collect as collect_advice
    from ..advice.output import advice_text
    from .simulate import check_gpu_option, target_hardware

    budget_bytes = parse_bytes(budget)
    check_gpu_option(gpu)
    if save_plan is not None:
        _check_save_path(save_plan, overwrite)
    trace = read_trace(trace_path)
    base = baseline_as_applied(trace)  # the loop as apply rewrites it
    hw = target_hardware(gpu, trace.meta.device, expandable_segments)
    # the last reader of the events; --expandable-segments: a setting already in use
    providers = None
    if compile_model:
        from ..advice import PROVIDERS
        from ..advice.compile_advice import compile_advice
        script = str(trace.meta.argv[0]) if trace.meta.argv else ""
        providers = PROVIDERS + [lambda _context: compile_advice(trace_path, script)]
    advice = collect_advice(trace, base, hw, providers=providers,
                            alloc_conf="expandable_segments:True"
                            if expandable_segments else None)
    release_events(trace)  # only the metadata is read from here on
    script, choice = _script_and_choice(trace, trace_path, verify_count, hw.device_type)
    verify_count = choice.count
    allowed = {a.strip() for a in allow.split(",") if a.strip()}
    shown = top
    baseline_record = None
    while True:
        result = advise(base, hw, budget_bytes, gpus, margin=margin, allow=allowed, top=shown,
                        expandable_segments=expandable_segments, objective=objective or "cost")
        data = advise_dict(base, result, hw)
        data["objective"] = objective or "cost"
        # unasked, a script that fits is left as it is: every plan changes something
        data["keep_as_is"] = (objective is None
                              and data["baseline_peak_bytes"] <= result.usable_bytes)
        if data["keep_as_is"] and verify_count and base.device_type != hw.device_type:
            # the unmodified script's peak on the target is itself a prediction here
            if baseline_record is None:
                baseline_record = _verify_baseline(base, script, trace.meta, hw,
                                                   result.usable_bytes, choice.default,
                                                   verify_depth)
            data["baseline_verification"] = baseline_record
            data["keep_as_is"] = not baseline_record["executed"] or baseline_record["fits"]
        checked = check_plans(data, result, script, trace.meta, hw,
                              0 if data["keep_as_is"] else verify_count,
                              fall_back=choice.default, depth=verify_depth)
        # every plan shown refused by apply for this script (a framework's FSDP on the CPU):
        # look further down the ranking for one it can realise, as far as all that fit
        if (data["best"] is not None or not checked or data["keep_as_is"] or verify_count
                or len(result.ranked) < shown):
            break
        shown *= 4
    if data["best"] is not None and data["best"] >= top:
        # the top plans and the first one apply can realise; the refused ones in between
        # are counted, not shown
        found = data["best"]
        data["refused_not_shown"] = found - top
        data["plans"] = data["plans"][:top] + [data["plans"][found]]
        result.ranked[:] = result.ranked[:top] + [result.ranked[found]]
        data["best"] = top
    best = data["best"]
    if data["keep_as_is"]:
        best = data["best"] = None
    data["verification"] = verification_summary(data, choice, hw, base)
    if save_plan is not None and (best is not None or data["keep_as_is"]):
        chosen = result.ranked[best].plan if best is not None else Plan()
        try:
            with open(save_plan, "w", encoding="utf-8") as f:
                json.dump(chosen.to_dict(), f, indent=2)
                f.write("\n")
        except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
            raise UserError(f"cannot write --save-plan {save_plan}: "
                            f"{getattr(exc, 'strerror', None) or exc}") from None
    data["advice"] = advice_dicts(advice)
    text = None if as_json else advise_text(data) + "\n" + advice_text(data["advice"],
                                                                     trace.meta.cwd or "")
    click.echo(json.dumps(data, indent=2) if as_json else safe_text(text))
    if best is None and checked and not data["keep_as_is"]:
        summary = data["verification"]
        if summary["plans_attempted"] and not summary["plans_executed"]:
            what = (f"{summary['unverified_reason']}; --verify 0 ranks by the analytic "
                    "figures alone (unverified)")
        elif summary["plans_executed"]:
            what = (f"none of the {summary['plans_executed']} plans executed fits the usable "
                    f"{format_bytes(result.usable_bytes)} (--verify K executes more; "
                    "--verify 0 ranks by the analytic figures alone, unverified)")
        else:
            what = (f"none of the {len(result.ranked)} plans that fit can be applied to this "
                    "script (apply's reasons above)")
        raise UserError(what + (f"; nothing written to {save_plan}" if save_plan else ""),
                        exit_code=1)
    return 0


def verification_summary(data: dict, choice, hw, base) -> dict:
    """``data['verification']``: whether the fits shown were decided by execution, how,
    and why not (``verify.policy``), with its line of text."""
    from ..verify.policy import fits_line, summary_dict
    if data["keep_as_is"]:  # the one fit declared is the unmodified script's
        records = [data["baseline_verification"]] if "baseline_verification" in data else []
    else:
        records = [p["verification"] for p in data["plans"] if p.get("verification")]
    executed = [r for r in records if r["executed"]]
    failed = next((r["failed"] or r["refused"] for r in records if not r["executed"]), None)
    first = executed[0] if executed else None
    summary = summary_dict(choice, hw.device_type, executed=len(executed),
                           attempted=len(records), method=first and first["method"],
                           where=first and first["where"].split(", ", 1)[0],
                           failed_reason=failed,
                           recorded=(data["keep_as_is"] and not records
                                     and base.device_type == hw.device_type),
                           baseline=data["keep_as_is"])
    summary["text"] = fits_line(summary, hw.device_type)
    return summary


def _verify_baseline(base, script, meta, hw, usable_bytes: int, fall_back: bool,
                     depth: str = "auto") -> dict:
    """Execute the unmodified script on the target (a trace of another device says what
    it needs there only by the analytic model): does it fit?  A failed execution is the
    reason in one line and exit 1 where --verify was asked for."""
    from ..errors import UserError
    from ..plan import Plan
    from ..simulate import simulate
    from ..verify import compare, verify_plan
    click.echo("memadvisor: executing the unmodified script to verify that it fits ...",
               err=True)
    verification = verify_plan(script, meta, Plan(), hw, depth=depth)
    record = compare(simulate(base, Plan(), hw), verification, usable_bytes)
    if not record["executed"] and not fall_back:
        raise UserError(f"the unmodified script could not be executed to verify that it "
                        f"fits: {record['failed'] or record['refused']}", exit_code=1)
    return record


def release_events(trace) -> None:
    """Give the trace's event table back once the baseline is made: pyarrow's allocator
    keeps what reading freed until asked, and the plan search never reads the events
    again."""
    import pyarrow

    trace.events = trace.events.iloc[:0]
    release = getattr(pyarrow.default_memory_pool(), "release_unused", None)
    if release is not None:
        release()


def _script_and_choice(trace, trace_path, asked: int | None, device_type: str):
    """(the profiled script or None, ``verify.policy.VerifyChoice``): the script to check
    plans against and how many plans to execute.  Asked to verify (--verify K) with the
    script gone: one line and exit 2; by default advise goes on with analytic fits and says
    why."""
    from ..errors import UserError
    from ..verify import recorded_script
    from ..verify.policy import choose
    from ..verify.script import locate_script
    script, problem = locate_script(trace.meta, trace_path)
    if problem is not None and asked:
        recorded_script(trace.meta, trace_path)  # raises --verify's own one line
        raise UserError(problem)
    return script, choose(asked, device_type, problem)


def check_plans(data: dict, result, script, meta, hw, verify_count: int,
                fall_back: bool = False, depth: str = "auto") -> bool:
    """Mark each shown plan that ``apply`` cannot realise for the script, execute the top
    ``verify_count`` others (as many more while none of them fits),
    and choose the best: the first plan realisable and -- where plans are executed --
    executed and fitting (a plan below the executed ones is not declared to fit on its
    analytic figure).  Where no execution completed at all, ``fall_back`` (the default
    verification, not asked for) chooses by the analytic figures as ``--verify 0`` would,
    and the output says so.  Fills ``data['best']`` (an index into ``data['plans']`` or
    None); returns whether plans were checked at all (the script was found)."""
    from ..verify import apply_refusals
    from ..verify.compare import plan_check_text
    data["apply_checked"] = script is not None
    data["verified"] = 0
    if script is None:
        data["best"] = 0 if data["plans"] else None
        return False
    # on the CPU target: also what the rewritten script would stop at there (FSDP under a
    # framework needs CUDA)
    refused = apply_refusals(script, [p.plan for p in result.ranked], hw.device_type)
    candidates = []
    for index, (shown, prediction) in enumerate(zip(data["plans"], result.ranked)):
        shown["apply_refused"] = refused.get(prediction.plan.to_compact())
        if shown["apply_refused"] is None:
            candidates.append(index)
    fitting = 0
    # the top K at once; K more only while none executed fits: the candidates run in rank
    # order, so the first batch with a fitting plan has decided the best
    while not fitting and candidates and data["verified"] < 2 * verify_count:
        batch = candidates[:min(verify_count, 2 * verify_count - data["verified"])]
        candidates = candidates[len(batch):]
        records = _execute(batch, result, script, meta, hw, depth)
        for index, record in zip(batch, records):
            data["plans"][index]["verification"] = record
            data["verified"] += 1
            fitting += bool(record["fits"])
    executed = any(p.get("verification", {}).get("executed") for p in data["plans"])
    # executions asked for and every one failed: by default, the analytic ranking (said)
    by_execution = bool(data["verified"]) and (executed or not fall_back)
    best = None
    for index, shown in enumerate(data["plans"]):
        shown["check_mark"], shown["check_notes"] = plan_check_text(shown)
        record = shown.get("verification")
        fits = bool(record and record["fits"]) if by_execution else True  # ranked: fit
        if best is None and shown["apply_refused"] is None and fits:
            best = index
    data["best"] = best
    return True


def _execute(indexes: list[int], result, script, meta, hw, depth: str = "auto") -> list[dict]:
    """Verify these ranked plans; fake executions run side by side (each rank of each plan
    a process, as many at once as there are cores, the costliest first), real CPU runs
    one after another (they share the cores the measured kernels would use)."""
    import contextlib
    from concurrent.futures import ThreadPoolExecutor

    from ..verify import compare, verify_plan
    from ..verify.execute import ChildSlots, plan_cost, ranks_to_run
    from .profile_fake import ChildServer
    fake = hw.device_type == "cuda"
    slots = ChildSlots(os.cpu_count() or 1)
    runs = {}  # each plan's fake runs, queued costliest first before any plan is rewritten
    for index in indexes:
        plan = result.ranked[index].plan
        runs[index] = [(plan.to_compact(), rank) for rank in ranks_to_run(plan.world)]
        if fake:
            for key in runs[index]:
                slots.reserve(key, plan_cost(plan))

    def one(index):
        prediction = result.ranked[index]
        try:
            verification = verify_plan(script, meta, prediction.plan, hw, slots=slots,
                                       server=server, depth=depth)
        finally:
            slots.cancel(runs[index])
        click.echo(f"memadvisor: executed plan {index + 1}, {prediction.plan} "
                   f"({verification.seconds:.0f} s)", err=True)
        return compare(prediction, verification, result.usable_bytes)

    click.echo(f"memadvisor: executing plan{'s' if len(indexes) > 1 else ''} "
               f"{', '.join(str(i + 1) for i in indexes)} to verify "
               f"{'them' if len(indexes) > 1 else 'it'} ...", err=True)
    # fake executions wait for a slot (ChildSlots) once rewritten: every plan gets a thread
    workers = len(indexes) if fake else 1
    with (ChildServer() if fake else contextlib.nullcontext()) as server, \
            ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(one, indexes))


def _check_save_path(path: str, overwrite: bool) -> None:
    """Refuse a path the plan cannot be written to before the search, not after it."""
    from ..errors import UserError

    if not path.strip():
        raise UserError("--save-plan needs a file name, e.g. --save-plan plan.json")
    if os.path.isdir(path):
        raise UserError(f"--save-plan {path} is a directory; name a file, e.g. "
                        f"{os.path.join(path, 'plan.json')}")
    parent = os.path.dirname(path) or "."
    if not os.path.isdir(parent):
        what = "is not a directory" if os.path.exists(parent) else "does not exist"
        raise UserError(f"--save-plan {path}: the folder {parent} {what}")
    if os.path.exists(path) and not overwrite:
        raise UserError(f"{path} exists; pass --overwrite to replace it")
