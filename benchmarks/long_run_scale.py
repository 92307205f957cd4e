"""A long run's trace through every reader: `summary`, `check`, `report` and `ui` on a
synthetic trace of ~5M events and 30,000 steps (issue 15's scale target).

    python benchmarks/long_run_scale.py [--events 5000000] [--steps 30000] [--keep DIR] [--check]

The trace is made by ``memadvisor.report.synthetic`` (not timed; ``--keep`` reuses it).  Each
command runs as a user runs it, the real CLI in its own process, and is timed from its start:

- ``summary TRACE`` until it exits (and its longest output line: a long run's per-step peaks
  must not make one 30,000-entry line);
- ``check TRACE --budget`` (twice the peak) until it exits;
- ``report TRACE -o OUT.html`` until it exits (and the file's size);
- ``ui TRACE --no-browser`` until the server answers the page and its layout; then, in
  this process, the callbacks that fill the page on opening (the dashboard's data loaded,
  the analysed step's timeline, what is alive at its peak, the plan table for the budget).
  ``ui`` counts both: start-up plus first views (a browser's own drawing is measured by
  dashboard_speed.py).

The trace holds all nine categories (the heaviest timeline a report draws).  Targets: each
within 10 s; the report under 5 MB (5,000,000 bytes); no summary line over 400 characters.
``--check`` exits 1 when one is missed.
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TIME_LIMIT_S = 10.0
SIZE_LIMIT_BYTES = 5_000_000
LINE_LIMIT_CHARS = 400
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def layers_for(events: int, steps: int) -> int:
    """Layers (3 modules each, 8 events per module per step with all categories, 2 more
    per step for the batch) giving at least ``events`` events with no temporaries."""
    per_step = events / steps
    return max(1, -(-int(per_step - 2) // 24))


def run_cli(*args: str) -> tuple[float, subprocess.CompletedProcess]:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "memadvisor.cli", *args], env=ENV,
                          capture_output=True, text=True, timeout=1800)
    return time.perf_counter() - started, done


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ui_startup(trace: Path, budget: int) -> tuple[float, int]:
    port = free_port()
    started = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "memadvisor.cli", "ui", str(trace), "--port", str(port),
         "--no-browser", "--budget", str(budget)], env=ENV, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}/"
    try:
        for url in (base, base + "_dash-layout"):
            while True:
                if proc.poll() is not None:
                    raise SystemExit(f"memadvisor ui exited: {proc.stderr.read()[-2000:]}")
                try:
                    with urllib.request.urlopen(url, timeout=30) as answer:
                        layout_bytes = len(answer.read())
                    break
                except (OSError, urllib.error.HTTPError):  # not bound yet / 503 while reading
                    time.sleep(0.05)
        return time.perf_counter() - started, layout_bytes
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def ui_first_views(trace: Path, budget: int) -> float:
    from memadvisor.ui import data as ui_data
    from memadvisor.ui.views import Dashboard

    started = time.perf_counter()
    board = Dashboard(ui_data.load(str(trace)), budget_bytes=budget)
    step = board.default_step()
    board.timeline_view(step, str(budget), None)
    board.moment_view(step, None)
    rows, _message, _selected = board.plans_view(str(budget), 1)
    if not rows:
        raise SystemExit("the dashboard ranked no plans")
    return time.perf_counter() - started


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=5_000_000)
    parser.add_argument("--steps", type=int, default=30_000)
    parser.add_argument("--keep", default=None, help="keep (and reuse) the trace in this folder")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)

    from memadvisor.report.synthetic import make_trace
    from memadvisor.trace.io import read_meta, read_trace
    from memadvisor.trace.summary import summarize

    folder = Path(args.keep or tempfile.mkdtemp(prefix="long_run_scale_"))
    folder.mkdir(parents=True, exist_ok=True)
    trace = folder / f"long_{args.events}_{args.steps}_all_categories.trace"
    if not trace.exists():
        made = time.perf_counter()
        make_trace(trace, args.events, steps=args.steps,
                   layers=layers_for(args.events, args.steps), hostile=False,
                   all_categories=True)
        print(f"made {trace} in {time.perf_counter() - made:.0f} s (not timed)", flush=True)
    import pyarrow.parquet as pq

    meta = read_meta(trace)
    events = pq.ParquetFile(trace).metadata.num_rows
    peak = summarize(read_trace(trace))["peak_bytes"]
    print(f"trace: {events:,} events, {meta.steps_completed:,} steps, "
          f"{trace.stat().st_size / 1e6:.1f} MB on disk; python {sys.version.split()[0]}, "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}", flush=True)

    missed = []

    def verdict(name: str, seconds: float, extra: str = "") -> None:
        ok = seconds <= TIME_LIMIT_S
        if not ok:
            missed.append(name)
        print(f"{name:<10}{seconds:>8.2f} s  (target <= {TIME_LIMIT_S:g} s: "
              f"{'met' if ok else 'NOT met'}){extra}", flush=True)

    seconds, done = run_cli("summary", str(trace))
    if done.returncode != 0:
        raise SystemExit(f"summary failed: {done.stderr}")
    longest = max((len(line) for line in done.stdout.splitlines()), default=0)
    if longest > LINE_LIMIT_CHARS:
        missed.append("summary line")
    verdict("summary", seconds, f"; longest line {longest} chars (target <= "
                                f"{LINE_LIMIT_CHARS}: {'met' if longest <= LINE_LIMIT_CHARS else 'NOT met'})")

    seconds, done = run_cli("check", str(trace), "--budget", str(2 * peak))
    if done.returncode != 0:
        raise SystemExit(f"check failed: {done.stderr}")
    verdict("check", seconds)

    out = folder / "long.html"
    seconds, done = run_cli("report", str(trace), "-o", str(out))
    if done.returncode != 0:
        raise SystemExit(f"report failed: {done.stderr}")
    size = out.stat().st_size
    if size > SIZE_LIMIT_BYTES:
        missed.append("report size")
    verdict("report", seconds, f"; {size / 1e6:.2f} MB (target < 5 MB: "
                               f"{'met' if size < SIZE_LIMIT_BYTES else 'NOT met'})")

    startup_s, layout_bytes = ui_startup(trace, 2 * peak)
    views_s = ui_first_views(trace, 2 * peak)
    verdict("ui", startup_s + views_s,
            f"; {startup_s:.2f} s until the page and its layout ({layout_bytes / 1e6:.2f} MB) "
            f"are served + {views_s:.2f} s for the first views in-process")
    if missed:
        print("missed: " + ", ".join(missed))
    return 1 if (args.check and missed) else 0


if __name__ == "__main__":
    raise SystemExit(main())
