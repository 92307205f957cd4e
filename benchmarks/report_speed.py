"""How long a report takes and how big it gets, for synthetic traces of 100k and 1M events.

    python benchmarks/report_speed.py [--events 100000,1000000] [--keep DIR]

Traces are made by ``memadvisor.report.synthetic`` (not timed).  Each row times the phases
of ``memadvisor report`` in-process: reading the trace, building the report's data (summary,
decimated timeline, plans, comparison), rendering and writing the HTML.  Variants:
``plain`` (no options), ``budget`` (``--budget``: the simulator ranks plans, where it is
installed), ``baseline`` (``--baseline`` against a second trace) and ``all`` (both).  The
traces hold all nine categories, the heaviest timeline a report draws.  The targets are 5 s
and 5 MB (5,000,000 bytes) for 1M events; plotly.js (gzipped, base64) is ~2.0 MB of that.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from memadvisor.report.build import build_report
from memadvisor.report.html import render_html, write_html
from memadvisor.report.synthetic import make_trace
from memadvisor.trace.io import read_trace
from memadvisor.trace.summary import summarize

TIME_LIMIT_S = 5.0
SIZE_LIMIT_BYTES = 5_000_000


def one_report(trace_path: Path, out: Path, *, budget_bytes: int | None = None,
               baseline_path: Path | None = None) -> dict:
    started = time.perf_counter()
    trace = read_trace(trace_path)
    baseline = read_trace(baseline_path) if baseline_path else None
    read_s = time.perf_counter() - started
    t = time.perf_counter()
    data = build_report(trace, budget_bytes=budget_bytes, baseline=baseline)
    build_s = time.perf_counter() - t
    t = time.perf_counter()
    write_html(out, render_html(data))
    render_s = time.perf_counter() - t
    total_s = time.perf_counter() - started
    return {"events": len(trace), "read_s": read_s, "build_s": build_s, "render_s": render_s,
            "total_s": total_s, "size_bytes": out.stat().st_size,
            "points": data.timeline.points, "plans": len(data.plans.predictions)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", default="100000,1000000",
                        help="comma-separated trace sizes (default: 100000,1000000)")
    parser.add_argument("--keep", default=None, help="keep traces and reports in this folder")
    args = parser.parse_args()
    sizes = [int(s) for s in args.events.split(",") if s.strip()]
    folder = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="report_speed_"))
    folder.mkdir(parents=True, exist_ok=True)

    header = (f"{'events':>10} {'variant':<9} {'read s':>7} {'build s':>8} {'render s':>9} "
              f"{'total s':>8} {'size MB':>8} {'points':>7} {'plans':>6}  verdict")
    print(header)
    print("-" * len(header))
    failed = False
    for size in sizes:
        # all nine categories: the heaviest timeline a report draws
        trace_path = make_trace(folder / f"t{size}.trace", size, all_categories=True)
        baseline_path = make_trace(folder / f"b{size}.trace", size, activation_scale=0.8,
                                   all_categories=True)
        # a budget 20% under the peak: over budget, so the plan section has work to do
        budget_bytes = int(summarize(read_trace(trace_path))["peak_bytes"] * 0.8)
        for variant in ("plain", "budget", "baseline", "all"):
            row = one_report(trace_path, folder / f"r{size}-{variant}.html",
                             budget_bytes=budget_bytes if variant in ("budget", "all") else None,
                             baseline_path=baseline_path if variant in ("baseline", "all")
                             else None)
            ok = row["total_s"] <= TIME_LIMIT_S and row["size_bytes"] <= SIZE_LIMIT_BYTES
            failed |= not ok
            print(f"{row['events']:>10,} {variant:<9} {row['read_s']:>7.2f} {row['build_s']:>8.2f} "
                  f"{row['render_s']:>9.2f} {row['total_s']:>8.2f} "
                  f"{row['size_bytes'] / 1e6:>8.3f} {row['points']:>7,} {row['plans']:>6}  "
                  f"{'ok' if ok else 'OVER'}")
    print(f"\nlimits: {TIME_LIMIT_S:g} s, {SIZE_LIMIT_BYTES / 1e6:g} MB; files in {folder}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
