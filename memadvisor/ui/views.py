"""The dashboard's callbacks as plain methods: inputs in, figures/rows/text out.

``Dashboard`` holds the data of one trace and the simulator bound to it; each method is
what one Dash callback returns, so tests call them directly without a server or a
browser (``app.py`` only wires them to component ids).  Text goes out as plain strings:
Dash renders them as text, never markup, whatever a module or file is called.
"""
from __future__ import annotations

import threading
from typing import Any

import plotly.graph_objects as go

from ..advice import INFO, MISSING, REFUSED, SUGGESTED
from ..advice.output import HEADINGS, short_location
from ..errors import UserError
from ..report.build import headline
from ..units import format_bytes, parse_bytes
from . import data as ui_data
from . import figures, memory
from .plans import PlanAdvisor, PlanRanking


#: moments kept (a click's table and chart are two requests; a step's peak is asked again)
KEPT_MOMENTS = 8
#: the fields of a moment's storages the page's grid shows (``app.MOMENT_COLUMNS``)
MOMENT_FIELDS = ("bytes", "category", "op", "module", "dtype", "shape", "source", "function")


def parse_budget(text: Any) -> int | None:
    """The budget input: '' or None -> no budget; bad text -> UserError (one line)."""
    if text is None or not str(text).strip():
        return None
    return parse_bytes(str(text))


def parse_gpus(value: Any) -> int:
    try:
        gpus = int(value)
    except (TypeError, ValueError):
        raise UserError(f"GPUs must be a whole number, got {value!r}") from None
    if gpus < 1:
        raise UserError(f"GPUs must be at least 1, got {gpus}")
    return gpus


class Dashboard:
    """One trace's dashboard state; every method is one callback's body."""

    def __init__(self, data: ui_data.DashboardData, *, budget_bytes: int | None = None,
                 num_gpus: int = 1, gpu: str | None = None, trace_name: str = "",
                 baseline_name: str = "", rank_now: bool = True,
                 advisor: PlanAdvisor | None = None):
        """``rank_now``: start pricing the plans for ``num_gpus`` (and ranking them for
        ``budget_bytes``) in the background at once, while the page is being built and
        served (``start_ranking``).  ``advisor``: one made (and started) already."""
        self.data = data
        self.budget_bytes = budget_bytes
        self.num_gpus = num_gpus
        self.advisor = advisor or PlanAdvisor(data.trace, gpu, after_job=memory.trim)
        self.trace_name = trace_name or data.trace.path or "trace"
        self.baseline_name = baseline_name
        self._moments: dict = {}
        self._moments_lock = threading.Lock()
        if rank_now and advisor is None:
            start_ranking(self.advisor, budget_bytes, num_gpus)

    # -- the timeline and a moment in it -------------------------------------------------

    def default_step(self) -> int:
        step = self.data.analysed_step
        return ui_data.WHOLE_RUN if step is None else step

    def timeline_view(self, step_value: Any, budget_text: Any = None
                      ) -> tuple[go.Figure, str]:
        """The step's timeline (a budget line when the budget input parses) and its
        caption.  A click never redraws it: only the tables below follow a click."""
        step = ui_data.step_value(step_value)
        timeline = self.data.timeline(step)
        fig = figures.timeline_figure(timeline, budget_bytes=self._budget_or_none(budget_text))
        # the step in the figure itself: a click names the step of the figure clicked.
        # One label per category at the hovered event, not the report's unified box: that
        # box follows the pointer, so plotly redrew it at every move (8 ms a move at 1M
        # events, the main thread a click's answer waits for); these move only when the
        # event under the pointer changes
        fig.update_layout(clickmode="event", height=420, hovermode="x",
                          meta={"step": ui_data.WHOLE_RUN if step is None else step})
        peak = timeline.peak or {}
        caption = (f"{timeline.events_in_step:,} events in the step, drawn as "
                   f"{timeline.points:,} points (each bucket keeps its lowest and highest "
                   f"point; the peak is exact). Peak {format_bytes(timeline.peak_bytes)} at "
                   f"event {peak.get('seq', '?')} during {peak.get('phase', '?')} in "
                   f"{peak.get('module') or '(top level)'} ({peak.get('op') or '?'}). "
                   "Click the chart to see what is alive at that moment.")
        return fig, caption

    def timeline_unit(self, step_value: Any, budget_text: Any = None) -> str:
        """The byte unit the step's timeline is drawn in for this budget: while it stays
        the same, a new budget moves only the budget line (``budget_layout``)."""
        timeline = self.data.timeline(ui_data.step_value(step_value))
        budget = self._budget_or_none(budget_text) or 0
        return figures.byte_scale(max(float(timeline.peak_bytes), float(budget)))[0]

    def budget_layout(self, step_value: Any, budget_text: Any = None) -> dict[str, Any]:
        """The timeline's layout (shapes, annotations, axes) for a new budget: what the page
        patches into the figure it has, without sending its data again."""
        figure = self.timeline_view(step_value, budget_text)[0]
        return figure.layout.to_plotly_json()

    @staticmethod
    def _budget_or_none(budget_text: Any) -> int | None:
        try:
            return parse_budget(budget_text)
        except UserError:
            return None

    def moment_view(self, step_value: Any, click_data: dict | None = None
                    ) -> tuple[str, go.Figure, list[dict[str, Any]]]:
        """What is alive at the clicked event (default: the step's peak): a caption, the
        bytes per category, and the storages largest first."""
        caption, rows = self.moment_table(step_value, click_data)
        return caption, self.moment_breakdown(step_value, click_data), rows

    def moment_table(self, step_value: Any, click_data: dict | None = None
                     ) -> tuple[str, list[dict[str, Any]]]:
        """The caption and rows of ``moment_view`` (a click's first answer: the page draws
        them before the chart)."""
        m, at_peak = self._moment(step_value, click_data)
        if m is None:
            return "no events in this step", []
        where = "the peak" if at_peak else "the selected moment"
        shown = (f"all {m.storage_count:,} storages" if len(m.rows) == m.storage_count else
                 f"the {len(m.rows):,} largest of {m.storage_count:,} storages "
                 f"({format_bytes(m.rows_bytes)} of {format_bytes(m.live_bytes)})")
        caption = (f"At {where}: {format_bytes(m.live_bytes)} live at {m.time_ms:.3f} ms "
                   f"(event {m.seq}, {m.phase}, {m.module or '(top level)'}, "
                   f"{m.op or '?'}); {shown}, largest first.")
        # only what the grid shows goes to the page, and row_id: what the grid knows a row
        # by (a string), so a storage alive at both moments keeps its row
        rows = [{**{name: r[name] for name in MOMENT_FIELDS}, "row_id": str(r["storage_id"])}
                for r in m.rows]
        return caption, rows

    def moment_breakdown(self, step_value: Any, click_data: dict | None = None) -> go.Figure:
        """The bytes per category of ``moment_view``."""
        m, at_peak = self._moment(step_value, click_data)
        if m is None:
            return figures.breakdown_figure({})
        where = "the peak" if at_peak else "the selected moment"
        return figures.breakdown_figure(m.by_category, title=f"Alive at {where}, by category")

    def _moment(self, step_value: Any, click_data: dict | None
                ) -> tuple[ui_data.Moment | None, bool]:
        """The moment a click points at (None: a step without events) and whether it is
        the step's peak; the last few kept (a click asks for its table and its chart)."""
        step = ui_data.step_value(step_value)
        position = ui_data.clicked_position(self.data, step, click_data)
        at_peak = position is None
        if at_peak:
            position = ui_data.peak_position(self.data, step)
        if position < 0:
            return None, at_peak
        key = (step, position)
        with self._moments_lock:
            known = self._moments.get(key)
        if known is None:
            known = ui_data.moment(self.data, position, step)
            with self._moments_lock:
                self._moments[key] = known
                while len(self._moments) > KEPT_MOMENTS:
                    self._moments.pop(next(iter(self._moments)))
        return known, at_peak

    def sites_view(self, step_value: Any) -> tuple[str, list[dict[str, Any]], go.Figure]:
        """The step's largest allocation sites alive at its peak (a caption, the table's
        rows) and the modules holding the most activations."""
        step = ui_data.step_value(step_value)
        sites = self.data.sites(step)
        rows = []
        for site in sites["top_sites"]:
            where = (f"{site['source_file']}:{site['source_line']} in "
                     f"{site['source_function']}" if site["source_file"]
                     else "(no user frame)")
            rows.append({"size": format_bytes(site["bytes"]), "bytes": site["bytes"],
                         "count": site["count"], "category": site["category"],
                         "op": site["op"], "module": site["module"] or "(top level)",
                         "source": where, "code": site["code"]})
        where = ("the whole run" if step is None else
                 f"step {step}" + (", the analysed step" if step == self.data.analysed_step
                                   else ""))
        meta = self.data.trace.meta
        caption = (f"Peak of {where}: {format_bytes(sites['peak_bytes'])}. Model state: "
                   f"parameters {format_bytes(meta.parameter_bytes)}, gradients "
                   f"{format_bytes(sites['gradient_bytes'])}, optimizer state "
                   f"{format_bytes(sites['optimizer_state_bytes'])}.")
        return caption, rows, figures.modules_figure(sites["top_activation_modules"])

    # -- the plans -----------------------------------------------------------------------

    def headline_text(self, budget_text: Any, gpus_value: Any) -> str:
        try:
            budget, gpus = parse_budget(budget_text), parse_gpus(gpus_value)
        except UserError:
            budget, gpus = None, 1
        return headline(self.data.summary, budget, gpus).text

    def plans_view(self, budget_text: Any, gpus_value: Any, wait_s: float | None = None
                   ) -> tuple[list[dict[str, Any]], str, list[int], bool]:
        """The plan table for the inputs: rows, a message, the row selected first, and
        whether the ranking is still being made (after ``wait_s`` seconds; None: wait)."""
        try:
            budget, gpus = parse_budget(budget_text), parse_gpus(gpus_value)
        except UserError as exc:
            return [], str(exc), [], False
        ranking: PlanRanking | None = self.advisor.rank(budget, gpus, wait_s)
        if ranking is None:
            return [], (f"ranking plans for {gpus} GPU(s) of {format_bytes(budget)} in the "
                        "background ..."), [], True
        first_fit = next((i for i, r in enumerate(ranking.rows) if r["fits"] == "yes"), None)
        return ranking.rows, ranking.message, [] if first_fit is None else [first_fit], False

    # -- the advice beyond plans ---------------------------------------------------------

    def advice_view(self, wait_s: float | None = None
                    ) -> tuple[list[dict[str, Any]], str, bool]:
        """The advice panel: rows (``advice_rows``), a message, and whether the worker is
        still making it (after ``wait_s`` seconds; None: wait)."""
        answer = self.advisor.advice(wait_s)
        if answer is None:
            return [], "reading the advice from the trace in the background ...", True
        rows = advice_rows(answer["advice"], self.data.trace.meta.cwd or "")
        if answer["note"]:
            return rows, answer["note"], False
        if not rows:
            return rows, ("none: no in-place change, allocator setting or data loading "
                          "change the trace shows would save anything"), False
        counts = ", ".join(f"{sum(r['status'] == s for r in rows)} {HEADINGS[s]}"
                           for s in ADVICE_ORDER if any(r["status"] == s for r in rows))
        return rows, (f"{counts}: what memadvisor advise lists beside its plans, for the "
                      "target above"), False

    def plan_view(self, selected_rows: list[int] | None, rows: list[dict] | None,
                  budget_text: Any = None) -> tuple[go.Figure | None, list[str]]:
        """The selected plan's predicted timeline beside the measured one, and its terms
        (what each category becomes and why, step-time terms, what changes)."""
        rows = rows if isinstance(rows, list) else []
        if not selected_rows or not isinstance(selected_rows, list) \
                or not isinstance(selected_rows[0], int) or not 0 <= selected_rows[0] < len(rows):
            return None, ["select a plan in the table to see its prediction"]
        row = rows[selected_rows[0]]
        spec = row.get("plan") if isinstance(row, dict) else None
        if not isinstance(spec, str):
            # rows come back from the browser: anything but a plan spec is not answered
            return None, ["select a plan in the table to see its prediction"]
        try:
            budget = parse_budget(budget_text)
            detail = self.advisor.detail(spec)
        except UserError as exc:
            return None, [str(exc)]
        lines = plan_explanation(detail)
        if not detail["timeline"]:
            return None, ["the simulator gave no timeline for this plan"] + lines
        measured = self.data.timeline(self.data.analysed_step)
        fig = figures.plan_timeline_figure(measured, detail["timeline"], spec,
                                           budget_bytes=budget)
        return fig, lines


def start_ranking(advisor: PlanAdvisor, budget_bytes: int | None, num_gpus: int) -> None:
    """Price the plans for ``num_gpus`` in the background, and rank them for the budget;
    then the advice beyond plans (after: the page waits for the ranking, not the advice)."""
    if budget_bytes:
        advisor.request(budget_bytes, num_gpus)
    else:
        advisor.price_in_background(num_gpus)
    advisor.advice_in_background()


#: the statuses in the order ``advice.collect`` sorts them (and ``advise`` prints them)
ADVICE_ORDER = (SUGGESTED, REFUSED, INFO, MISSING)


def advice_rows(advice: list[dict[str, Any]], base_folder: str) -> list[dict[str, Any]]:
    """``advice.collect``'s items (as dicts) as the panel's rows, in its order: the status
    headed as ``advise`` heads it, the location shortened as ``advise`` and ``report``
    shorten it, the figures as numbers (the grid formats and sorts them)."""
    return [{"row_id": str(i), "status": item["status"],
             "group": HEADINGS.get(item["status"], item["status"]),
             "kind": item["kind"].replace("_", " "), "title": item["title"],
             "bytes_saved": _bytes_shown(item),
             "ms_per_step": None if item.get("seconds") is None
             else round(float(item["seconds"]) * 1e3, 3),
             "source": short_location(item["location"], base_folder),
             "reason": item["reason"]} for i, item in enumerate(advice)]


def plan_explanation(detail: dict[str, Any]) -> list[str]:
    """``simulate``'s explanation of one plan as lines of text."""
    per = " per rank" if detail["per_rank"] else ""
    lines = [f"{detail['plan_compact'] or 'none'} on {detail['hardware_description']}: "
             f"peak{per} {format_bytes(detail['peak_bytes'])} (baseline "
             f"{format_bytes(detail['baseline_peak_bytes'])}), step time "
             f"x{detail['step_time_factor']:.3f}"]
    if detail["reserved_bytes"] is not None and detail["reserved_bytes"] != detail["peak_bytes"]:
        lines.append(f"allocator: allocated {format_bytes(detail['allocated_bytes'])}, "
                     f"reserved {format_bytes(detail['reserved_bytes'])}")
    lines += [f"at the peak: {term}" for term in detail["terms"]]
    lines += [f"why it saves little: {reason}" for reason in detail["why_little"]]
    lines += [f"step time: {t['seconds'] * 1e3:+.2f} ms {t['what']}"
              for t in detail["cost_terms"]]
    if detail["assumptions"]:
        lines.append("assumptions: " + "; ".join(detail["assumptions"]))
    lines.append("changes: " + "; ".join(detail["changes"]))
    lines += [f"warning: {w}" for w in detail["warnings"]]
    return lines


def _bytes_shown(item: dict[str, Any]) -> int | None:
    """The bytes figure of a row: as ``advise`` says "saves 0 B" of a suggested change that
    frees nothing at the peak (but not of a data loading one: its figure is time), and
    leaves out a refused one's unless it is not 0."""
    if (item["status"] == SUGGESTED and item["kind"] != "data_loading") \
            or item["bytes_saved"]:
        return int(item["bytes_saved"])
    return None
