"""The report as one self-contained HTML page (``ReportData`` -> str).

Offline by construction: plotly.js is inlined once in the head, figures are JSON drawn by
``Plotly.newPlot``, fonts are the system's.  Every string from the trace goes through
``e()`` (HTML) or, inside the figures' JSON, is escaped so no ``<`` ever reaches the page
raw: a module named ``<script>`` shows as text.
"""
from __future__ import annotations

import base64
import datetime as _dt
import functools
import gzip
import html
import json
from pathlib import Path
from typing import Any

from ..advice.output import short_location
from ..ui import figures
from ..units import format_bytes as fb
from .build import ReportData

CSS = """
:root { --fg:#1d1d1f; --muted:#666; --line:#ddd; --ok:#1a7f37; --bad:#cf222e; }
* { box-sizing: border-box; }
body { font-family: %(font)s; color: var(--fg); margin: 0 auto; max-width: 1200px;
       padding: 24px; line-height: 1.45; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 18px; margin: 32px 0 8px;
     border-bottom: 1px solid var(--line); padding-bottom: 4px; }
.meta { color: var(--muted); font-size: 13px; }
.headline { font-size: 18px; padding: 12px 16px; border-radius: 6px; margin: 16px 0;
            border: 1px solid var(--line); background: #f6f8fa; }
.headline.fits { border-color: var(--ok); background: #dafbe1; }
.headline.over { border-color: var(--bad); background: #ffebe9; }
.notice { padding: 10px 14px; border-left: 4px solid #bf8700; background: #fff8c5; }
table { border-collapse: collapse; font-size: 13px; width: 100%%; }
th, td { text-align: left; padding: 4px 8px; border-bottom: 1px solid var(--line);
         vertical-align: top; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
tr.recommended { background: #dafbe1; font-weight: 600; }
code { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size: 12px; }
.grid { display: grid; grid-template-columns: 1fr 1fr; gap: 16px; }
@media (max-width: 900px) { .grid { grid-template-columns: 1fr; } }
.chart { width: 100%%; }
footer { margin-top: 40px; color: var(--muted); font-size: 12px; }
""" % {"font": figures.FONT_FAMILY}


def e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def script_json(value: Any) -> str:
    """JSON safe inside <script>: no '<', '>' or '&' (so no '</script>'), no line separators."""
    return (value.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def _table(headers: list[tuple[str, str]], rows: list[list[str]], row_classes=None,
           table_id: str = "") -> str:
    """``headers``: (title, css class); cells are HTML already escaped by the caller."""
    head = "".join(f'<th class="{cls}">{e(title)}</th>' for title, cls in headers)
    body = []
    for i, row in enumerate(rows):
        cls = f' class="{row_classes[i]}"' if row_classes and row_classes[i] else ""
        cells = "".join(f'<td class="{headers[j][1]}">{cell}</td>' for j, cell in enumerate(row))
        body.append(f"<tr{cls}>{cells}</tr>")
    ident = f' id="{table_id}"' if table_id else ""
    return f"<table{ident}><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _signed(value: int) -> str:
    return ("+" if value > 0 else "") + fb(value) if value else "0"


class _Page:
    """Collects sections and the figures they place.

    Arrays are embedded once: the timeline's categories share one x, and the plan chart
    reuses it, so each distinct encoded array goes into a pool the figures point into
    (``{"$pool": i}``), resolved in the browser before plotting.  Plotly.js alone is 4.8 MB
    of the 5 MB a report may weigh; this keeps the data of a full timeline near 100 kB.
    """

    MIN_POOLED = 256  #: shorter encoded arrays are cheaper left in place

    def __init__(self):
        self.figures: dict[str, Any] = {}  # div id -> figure dict (arrays pooled)
        self.pool: list[dict[str, str]] = []
        self._pool_index: dict[tuple[str, str], int] = {}

    def chart(self, div_id: str, fig) -> str:
        self.figures[div_id] = self._intern(json.loads(fig.to_json()))
        return f'<div id="{div_id}" class="chart"></div>'

    def _intern(self, node: Any) -> Any:
        if isinstance(node, dict):
            if isinstance(node.get("bdata"), str) and len(node["bdata"]) >= self.MIN_POOLED:
                key = (str(node.get("dtype")), node["bdata"])
                if key not in self._pool_index:
                    self._pool_index[key] = len(self.pool)
                    self.pool.append(node)
                return {"$pool": self._pool_index[key]}
            return {k: self._intern(v) for k, v in node.items()}
        if isinstance(node, list):
            return [self._intern(v) for v in node]
        return node

    def figures_script(self) -> str:
        payload = json.dumps({"pool": self.pool, "figures": self.figures},
                             separators=(",", ":"))
        return ("<script>(function(){var report=" + script_json(payload) + ";"
                "function resolve(node){if(Array.isArray(node)){return node.map(resolve);}"
                "if(node&&typeof node==='object'){if('$pool' in node){var a=report.pool["
                "node['$pool']],c={};for(var k in a){c[k]=a[k];}return c;}"
                "var out={};for(var k in node){out[k]=resolve(node[k]);}return out;}"
                "return node;}"
                "function draw(){var config={responsive:true,displaylogo:false};"
                "for(var id in report.figures){var fig=resolve(report.figures[id]);"
                "Plotly.newPlot(id,fig.data,fig.layout,config);}}"
                + UNPACK_PLOTLY_JS + "})();</script>")


def _header(data: ReportData) -> str:
    meta = data.trace.meta
    s = data.summary
    status = "" if meta.status == "completed" else (
        f'<p class="notice">The profiled run ended with status <b>{e(meta.status)}</b>: '
        f"{e(meta.error)}. Numbers cover what ran.</p>")
    device = e(meta.device) + (f" ({e(meta.device_name)})" if meta.device_name else "")
    return (f"<header><h1>Memory report: {e(meta.script or data.trace.path)}</h1>"
            f'<div class="meta">trace <code>{e(data.trace.path)}</code> · {s["events"]:,} events'
            f" · {meta.steps_completed} steps · device {device}"
            f" · torch {e(meta.torch_version or '?')}</div>{status}</header>")


def _headline(data: ReportData) -> str:
    h = data.headline
    cls = "" if h.fits is None else ("fits" if h.fits else "over")
    lines = [e(h.text)]
    rec = data.plans.recommended
    if rec is not None:
        which = "Recommended plan" if data.plans.requested == "budget" else "Plan"
        verdict = {True: " (fits, by the analytic model: not executed)",
                   False: " (does not fit)", None: " (analytic: not executed)"}[rec.fits]
        lines.append(f"{which} <code>{e(rec.plan)}</code>: analytic peak "
                     f"{fb(rec.peak_bytes)}, step time ×{rec.step_time_factor:.2f}{verdict}")
    return f'<div id="headline" class="headline {cls}">{"<br>".join(lines)}</div>'


def _timeline(page: _Page, data: ReportData) -> str:
    t = data.timeline
    fig = figures.timeline_figure(t, budget_bytes=data.headline.budget_bytes)
    peak = t.peak or {}
    return (f'<section id="timeline-section"><h2>Memory timeline</h2>'
            f'<p class="meta">{t.events_in_step:,} events in the step, drawn as {t.points:,} '
            f"points (each bucket keeps its lowest and highest point; the peak is exact). "
            f"Peak {fb(t.peak_bytes)} at event {peak.get('seq', '?')} during "
            f"{e(peak.get('phase', '?'))} in <code>{e(peak.get('module') or '(top level)')}"
            f"</code> ({e(peak.get('op') or '?')}).</p>{page.chart('fig-timeline', fig)}"
            f"</section>")


def _out_of_memory(data: ReportData) -> str:
    if not data.out_of_memory:
        return ""
    return ('<section id="out-of-memory"><h2>Out of memory</h2><pre>'
            + e("\n".join(data.out_of_memory)) + "</pre></section>")


def _breakdown(page: _Page, data: ReportData) -> str:
    s = data.summary
    total = max(s["peak_bytes"], 1)
    rows = [[e(c), f"{fb(b)}", f"{100 * b / total:.1f}%"]
            for c, b in sorted(s["by_category"].items(), key=lambda kv: -kv[1])]
    table = _table([("category", ""), ("bytes", "num"), ("share", "num")], rows,
                   table_id="breakdown-table")
    state = (f"Model state: parameters {fb(s['parameter_bytes'])}, gradients "
             f"{fb(s['gradient_bytes'])}, optimizer state {fb(s['optimizer_state_bytes'])}.")
    return (f'<section id="breakdown"><h2>At the peak</h2><div class="grid"><div>'
            f"{page.chart('fig-breakdown', figures.breakdown_figure(s['by_category']))}</div>"
            f'<div>{table}<p class="meta">{state}</p></div></div></section>')


def _sites(data: ReportData) -> str:
    rows = []
    for site, code in zip(data.summary["top_sites"], data.source_code or
                          [""] * len(data.summary["top_sites"])):
        where = (f"<code>{e(site['source_file'])}:{site['source_line']}</code> in "
                 f"<code>{e(site['source_function'])}</code>"
                 if site["source_file"] else "(no user frame)")
        if code:
            where += f"<br><code>{e(code)}</code>"
        rows.append([fb(site["bytes"]), str(site["count"]), e(site["category"]),
                     f"<code>{e(site['op'])}</code>", e(site["module"] or "(top level)"), where])
    table = _table([("bytes", "num"), ("count", "num"), ("category", ""), ("op", ""),
                    ("module", ""), ("source", "")], rows, table_id="sites-table")
    return (f'<section id="sites"><h2>Largest allocation sites alive at the peak</h2>'
            f"{table if rows else '<p>No allocation alive at the peak.</p>'}</section>")


def _modules(page: _Page, data: ReportData) -> str:
    modules = data.summary["top_activation_modules"]
    if not modules:
        return ('<section id="modules"><h2>Activations per module</h2>'
                "<p>No activations were saved.</p></section>")
    return ('<section id="modules"><h2>Activations per module</h2>'
            f"{page.chart('fig-modules', figures.modules_figure(modules))}</section>")


def _plans(page: _Page, data: ReportData) -> str:
    p = data.plans
    title = '<section id="plans"><h2>Plans</h2>'
    if not p.available or not p.predictions:
        message = p.message or "no plan predictions"
        return f'{title}<p class="notice" id="plans-notice">{e(message)}</p></section>'
    rows, classes = [], []
    for plan in p.predictions:
        fits = {True: "yes", False: "no", None: "—"}[plan.fits]
        changes = e(plan.changes)
        if plan.apply_refused:  # recommended nowhere: `apply` would refuse it
            changes += (f'<br><span class="notice">memadvisor apply cannot realise it for '
                        f'this script: {e(plan.apply_refused)}</span>')
        rows.append([f"<code>{e(plan.plan)}</code>", fb(plan.peak_bytes), fb(plan.reserved_bytes),
                     f"×{plan.step_time_factor:.2f}", fits, changes])
        classes.append("recommended" if plan is p.recommended else "")
    table = _table([("plan", ""), ("analytic peak", "num"), ("reserved", "num"),
                    ("step time", "num"), ("fits (analytic)", ""), ("what changes", "")], rows,
                   classes, table_id="plan-table")
    from ..verify.policy import report_note  # the figures are analytic: said, not executed
    device_type = "cuda" if str(data.trace.meta.device).startswith("cuda") else "cpu"
    parts = [title, f'<p class="meta" id="plans-basis">{e(report_note(device_type))}</p>',
             table]
    if p.message:
        parts.append(f'<p class="notice">{e(p.message)}</p>')
    rec = p.recommended
    if rec is not None and rec.timeline:
        fig = figures.plan_timeline_figure(data.timeline, rec.timeline, rec.plan,
                                           budget_bytes=data.headline.budget_bytes)
        parts.append(f"<h3>Measured and predicted ({e(rec.plan)})</h3>"
                     f"{page.chart('fig-plan-timeline', fig)}")
    elif rec is not None:
        parts.append('<p class="meta">The simulator gave no timeline for this plan.</p>')
    return "".join(parts) + "</section>"


#: how each advice status is headed in the report's table
_ADVICE_STATUS = {"suggested": "suggested", "refused": "refused", "info": "measured",
                  "missing": "not known from the trace"}


def _advice(data: ReportData) -> str:
    title = ('<section id="advice"><h2>Advice beyond plans</h2><p class="meta">Read from '
             "the trace: in-place ops, caching-allocator settings, data loading.  Bytes are "
             "off the analysed step's peak (reserved memory for allocator settings); refused "
             "changes would break autograd or the script.</p>")
    if not data.advice:
        message = data.advice_note or ("None: no change the trace shows would save "
                                       "anything.")
        return f'{title}<p id="advice-none">{e(message)}</p></section>'
    rows = []
    for item in data.advice:
        saves = fb(item["bytes_saved"]) if item["bytes_saved"] else ""
        if item.get("seconds") is not None:
            saves += (" · " if saves else "") + f"{item['seconds'] * 1e3:.2f} ms/step"
        rows.append([e(_ADVICE_STATUS.get(item["status"], item["status"])),
                     e(item["kind"].replace("_", " ")), f"<code>{e(item['title'])}</code>",
                     e(short_location(item["location"], data.trace.meta.cwd or "")),
                     e(saves), e(item["reason"])])
    table = _table([("status", ""), ("kind", ""), ("change", ""), ("where", ""),
                    ("saves", "num"), ("why", "")], rows,
                   [item["status"] == "suggested" and item["bytes_saved"] > 0
                    and "recommended" or "" for item in data.advice], "advice-table")
    return title + table + "</section>"


def _comparison(page: _Page, data: ReportData) -> str:
    c = data.comparison
    if c is None:
        return ""
    ratio = c["peak_change_ratio"]
    pct = f" ({100 * ratio:+.1f}%)" if ratio is not None else ""
    head = (f"Baseline <code>{e(data.baseline_path)}</code> step {c['a']['step']}: peak "
            f"{fb(c['a']['peak_bytes'])} → this trace {fb(c['b']['peak_bytes'])}, "
            f"{_signed(c['peak_change_bytes'])}{pct}.")

    def rows_of(rows):
        return [[e(r["name"]), fb(r["a_peak_bytes"]), fb(r["b_peak_bytes"]),
                 _signed(r["peak_change_bytes"]), fb(r["a_allocated_bytes"]),
                 fb(r["b_allocated_bytes"]), _signed(r["allocated_change_bytes"])] for r in rows]

    headers = [("", ""), ("baseline at peak", "num"), ("now at peak", "num"), ("change", "num"),
               ("baseline allocated", "num"), ("now allocated", "num"), ("change", "num")]
    fig = figures.comparison_figure(c, a_name="baseline", b_name="this trace")
    modules = (_table(headers, rows_of(c["by_module"]), table_id="compare-modules")
               if c["by_module"] else "<p>No module changed.</p>")
    return (f'<section id="comparison"><h2>Against the baseline</h2><p>{head}</p>'
            f"{page.chart('fig-comparison', fig)}"
            f"{_table(headers, rows_of(c['by_category']), table_id='compare-categories')}"
            f"<h3>Modules that changed most</h3>{modules}</section>")


def _steps(data: ReportData) -> str:
    rows = [[str(s["index"]), fb(s["peak_bytes"]),
             "" if s["duration_s"] is None else f"{1000 * s['duration_s']:.1f} ms"]
            for s in data.summary["steps"]]
    return (f'<section id="steps"><h2>Steps</h2>'
            f"{_table([('step', 'num'), ('peak', 'num'), ('duration', 'num')], rows)}"
            f'<p class="meta">The report analyses the last complete step; the first step '
            f"usually peaks lower because optimizer state does not exist yet.</p></section>")


#: plotly.js travels gzipped in base64 (4.8 MB -> 2.0 MB): the browser unpacks it with
#: DecompressionStream (Chrome 80, Firefox 113, Safari 16.4), runs it in the global scope,
#: then draws; an older browser gets a notice instead of a blank page
UNPACK_PLOTLY_JS = (  # no '<' in it: the figures' script is kept free of them
    "var packed=document.getElementById('plotly-js-gzip').textContent;"
    "if(typeof DecompressionStream==='undefined'){var note=document.createElement('p');"
    "note.className='notice';note.textContent='The charts need a browser that can unpack "
    "them (DecompressionStream: Chrome 80, Firefox 113, Safari 16.4 or later).';"
    "document.body.insertBefore(note,document.body.firstChild);return;}"
    "var bin=atob(packed),bytes=new Uint8Array(bin.length);"
    "for(var i=0;bin.length>i;i++){bytes[i]=bin.charCodeAt(i);}"
    "new Response(new Blob([bytes]).stream().pipeThrough(new DecompressionStream('gzip')))"
    ".text().then(function(js){(0,eval)(js);draw();});")


@functools.lru_cache(maxsize=1)  # the same plotly.js every time: compress it once
def pack_plotly_js(plotly_js: str) -> str:
    """plotly.js gzipped (fixed mtime: the same input packs to the same bytes) in base64."""
    return base64.b64encode(gzip.compress(plotly_js.encode("utf-8"), 9, mtime=0)).decode()


def render_html(data: ReportData, plotly_js: str | None = None) -> str:
    """The page.  ``plotly_js`` defaults to the plotly.js bundled with the plotly package."""
    if plotly_js is None:
        from plotly.offline import get_plotlyjs

        plotly_js = get_plotlyjs()
    page = _Page()
    body = [_header(data), _headline(data), _out_of_memory(data), _timeline(page, data),
            _breakdown(page, data),
            _sites(data), _modules(page, data), _plans(page, data), _advice(data),
            _comparison(page, data),
            _steps(data)]
    generated = _dt.datetime.fromtimestamp(data.generated_unix_s, _dt.timezone.utc)
    title = e(f"memadvisor report: {data.trace.meta.script or data.trace.path}")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{title}</title><style>{CSS}</style>"
            f'<script id="plotly-js-gzip" type="application/gzip;base64">'
            f"{pack_plotly_js(plotly_js)}</script></head><body>"
            + "".join(body)
            + f"<footer>memadvisor · generated {generated:%Y-%m-%d %H:%M} UTC</footer>"
            + page.figures_script() + "</body></html>\n")


def write_html(path: str | Path, text: str) -> Path:
    from ..output_files import write_output
    return write_output(path, lambda where: Path(where).write_text(text, encoding="utf-8"))
