"""What profiling costs per training step: memadvisor against no profiler and torch.profiler.

    python benchmarks/profile_overhead.py [--examples gpt_lm,cnn_classifier,mlp_regressor]
        [--steps 8] [--warmup 2] [--rounds 2] [--threads N] [--json FILE] [--check]

Each bundled example runs at a realistic CPU size, in this one process, under each
variant: ``plain`` (nothing attached), ``memadvisor`` (a ``ProfileSession``, as
``memadvisor profile`` runs it: the native engine on a machine without a GPU),
``memadvisor-dispatch`` (the same with the Python dispatch-mode engine) and ``torch.profiler``
(``profile_memory=True, with_stack=True``, the closest built-in tool).  Every variant runs
the example's own ``main()`` with the same arguments and seed, after one untimed warm-up
run, and the variants take turns (``--rounds`` times) so that a machine getting busier or
quieter affects them alike.

A step is timed by a global optimizer step post-hook that records ``time.perf_counter()``
(and ``time.process_time()``): a step's time is the gap between two optimizer steps.  The
first ``--warmup`` steps of each run are dropped; the figure is the median over the
remaining steps of all rounds.  Tables: median wall ms per step and ratios to plain; the
same in this process's CPU time (steadier where other programs share the machine; use
``--threads 1`` there too, as spinning OpenMP threads make both clocks erratic); the time
to produce the result once training stops (building the trace, torch.profiler's
post-processing), which no step includes; and the extra seconds of a whole run.

The target is memadvisor <= 1.3x plain on the GPT example, and below torch.profiler's
overhead everywhere; ``--check`` exits 1 when it is missed.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import io
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLES_DIR = REPO_ROOT / "examples"

#: arguments that make a step of each example take >= 50 ms on a CPU of a few cores
EXAMPLE_ARGS = {
    "gpt_lm": ["--n-layer", "4", "--d-model", "256", "--n-head", "8", "--seq-len", "128",
               "--batch-size", "8", "--vocab-size", "8192"],
    "cnn_classifier": ["--channels", "32", "--image-size", "32", "--batch-size", "64"],
    "mlp_regressor": ["--in-features", "512", "--hidden", "1024", "--depth", "4",
                      "--batch-size", "256"],
}
GPT_TARGET_RATIO = 1.3


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}",
                                                  EXAMPLES_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class StepClock:
    """Times every optimizer step of whatever runs while it is installed: wall time
    (``perf_counter``) and this process's CPU time (``process_time``), which other
    programs on a shared machine disturb much less."""

    def __init__(self):
        self.stamps: list[tuple[float, float]] = []
        self._handle = None

    def __enter__(self):
        self._handle = register_optimizer_step_post_hook(
            lambda *_: self.stamps.append((time.perf_counter(), time.process_time())))
        return self

    def __exit__(self, *exc):
        self._handle.remove()

    def step_times_s(self, warmup: int, clock: int = 0) -> list[float]:
        """Per-step seconds of ``clock`` (0 wall, 1 CPU) after the warm-up steps."""
        gaps = [b[clock] - a[clock] for a, b in zip(self.stamps, self.stamps[1:])]
        # gap k is step k+1; drop steps 0..warmup-1
        return gaps[max(warmup - 1, 0):]


@contextlib.contextmanager
def _variant(name: str, info: dict):
    """Run the body under one variant; ``info['finish_s']`` is what producing the result
    costs once training stops (building the trace / torch.profiler's post-processing)."""
    info["finish_s"] = 0.0
    if name == "plain":
        yield
    elif name in ("memadvisor", "memadvisor-dispatch"):
        from memadvisor.profile import ProfileSession

        kwargs = {"engine": "dispatch"} if name == "memadvisor-dispatch" else {}
        session = ProfileSession(**kwargs)  # no step limit: the example runs all its steps
        with session:
            yield
        started = time.perf_counter()
        table, _meta = session.build()
        info["finish_s"] = time.perf_counter() - started
        info["events"] = table.num_rows
        info["native_hook"] = f"{session.engine} engine ({session.engine_status})"
    elif name == "torch.profiler":
        from torch.profiler import ProfilerActivity, profile

        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                       with_stack=True)
        prof.__enter__()
        try:
            yield
        finally:
            started = time.perf_counter()
            prof.__exit__(None, None, None)
            prof.events()  # the event list a user of the profile reads
            info["finish_s"] = time.perf_counter() - started
    else:
        raise ValueError(name)


def _variants() -> tuple[str, ...]:
    from memadvisor.profile import ProfileSession

    engines = "engine" in inspect.signature(ProfileSession).parameters
    return ("plain", "memadvisor", *(["memadvisor-dispatch"] if engines else []),
            "torch.profiler")


def time_variant(example, args: list[str], variant: str, steps: int, warmup: int) -> dict:
    info: dict = {}
    argv = [*args, "--steps", str(warmup + steps), "--log-every", "1000000", "--seed", "0"]
    with StepClock() as clock, contextlib.redirect_stdout(io.StringIO()):
        with _variant(variant, info):
            example.main(argv)
    info["wall_s"] = clock.step_times_s(warmup)
    info["cpu_s"] = clock.step_times_s(warmup, clock=1)
    return info


def measure(name: str, steps: int, warmup: int, rounds: int) -> dict:
    """Median wall and CPU ms per step of every variant, the variants taking turns."""
    example = load_example(name)
    variants = _variants()
    # one untimed run first: the process's first steps pay for page faults, oneDNN
    # primitive creation and lazy imports that no variant should be charged for
    time_variant(example, EXAMPLE_ARGS[name], "plain", 1, warmup)
    wall = {variant: [] for variant in variants}
    cpu = {variant: [] for variant in variants}
    finish = {variant: [] for variant in variants}
    row = {"example": name, "events_per_step": 0.0, "native_hook": "n/a"}
    for _ in range(rounds):
        for variant in variants:
            info = time_variant(example, EXAMPLE_ARGS[name], variant, steps, warmup)
            wall[variant].extend(info["wall_s"])
            cpu[variant].extend(info["cpu_s"])
            finish[variant].append(info["finish_s"])
            if variant == "memadvisor":
                row["events_per_step"] = info["events"] / (warmup + steps)
                row["native_hook"] = info["native_hook"]
    row["wall_ms"] = {v: 1000 * statistics.median(t) for v, t in wall.items()}
    row["cpu_ms"] = {v: 1000 * statistics.median(t) for v, t in cpu.items()}
    for clock in ("wall", "cpu"):
        row[f"{clock}_ratio"] = {v: row[f"{clock}_ms"][v] / row[f"{clock}_ms"]["plain"]
                                 for v in variants}
    row["finish_s"] = {v: statistics.median(t) for v, t in finish.items()}
    row["steps_timed"] = {v: len(t) for v, t in wall.items()}
    row["steps_per_run"] = warmup + steps
    return row


def verdict(row: dict) -> str:
    ratio = row["wall_ratio"]
    problems = []
    if row["example"] == "gpt_lm" and ratio["memadvisor"] > GPT_TARGET_RATIO:
        problems.append(f"memadvisor > {GPT_TARGET_RATIO}x")
    if ratio["memadvisor"] >= ratio["torch.profiler"]:
        problems.append("not below torch.profiler")
    return "MISSED: " + ", ".join(problems) if problems else "ok"


SHORT = {"plain": "plain", "memadvisor": "memadv", "memadvisor-dispatch": "ma-disp",
         "torch.profiler": "torch.prof"}


def print_table(rows: list[dict]) -> None:
    variants = list(rows[0]["wall_ms"])
    profiled = [v for v in variants if v != "plain"]
    head = f"{'example':<15}" + "".join(f"{SHORT[v]:>11}" for v in variants)
    head += "".join(f"{SHORT[v] + '/pl':>14}" for v in profiled)
    head += f"{'events/step':>12}  verdict"
    print("\nwall time, median ms per step, and ratios to plain")
    print(head)
    print("-" * len(head))
    for row in rows:
        line = f"{row['example']:<15}" + "".join(f"{row['wall_ms'][v]:>11.1f}"
                                                 for v in variants)
        line += "".join(f"{row['wall_ratio'][v]:>13.2f}x" for v in profiled)
        line += f"{row['events_per_step']:>12.0f}  {verdict(row)}"
        print(line)
    print("\nCPU time of this process, median ms per step, and ratios to plain "
          "(less disturbed by other programs)")
    print(head.replace("  verdict", "").replace("events/step", "").rstrip())
    for row in rows:
        line = f"{row['example']:<15}" + "".join(f"{row['cpu_ms'][v]:>11.1f}"
                                                 for v in variants)
        line += "".join(f"{row['cpu_ratio'][v]:>13.2f}x" for v in profiled)
        print(line)
    print("\nproducing the result once training stops, median s (memadvisor: building the "
          "trace table; torch.profiler: stopping and listing its events)")
    print(f"{'example':<15}" + "".join(f"{SHORT[v]:>11}" for v in profiled))
    for row in rows:
        print(f"{row['example']:<15}" + "".join(f"{row['finish_s'][v]:>11.2f}"
                                                for v in profiled))
    steps = rows[0]["steps_per_run"]
    print(f"\nextra seconds for a whole run of {steps} steps (CPU-time overhead per step x "
          f"{steps} + producing the result)")
    print(f"{'example':<15}" + "".join(f"{SHORT[v]:>11}" for v in profiled))
    for row in rows:
        extra = {v: steps * (row["cpu_ms"][v] - row["cpu_ms"]["plain"]) / 1000
                 + row["finish_s"][v] for v in profiled}
        print(f"{row['example']:<15}" + "".join(f"{extra[v]:>11.2f}" for v in profiled))
    hooks = {row["example"]: row["native_hook"] for row in rows}
    print(f"\nmemadvisor's engine: {hooks}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", default=",".join(EXAMPLE_ARGS))
    parser.add_argument("--steps", type=int, default=8, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per run")
    parser.add_argument("--rounds", type=int, default=2,
                        help="times each variant runs, taking turns with the others")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's choice); 1 is steadier "
                             "on a machine other work is using")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when a target is missed")
    args = parser.parse_args(argv)
    names = [n for n in args.examples.split(",") if n]
    unknown = [n for n in names if n not in EXAMPLE_ARGS]
    if unknown:
        parser.error(f"unknown examples: {', '.join(unknown)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{os.cpu_count()} CPUs; {args.steps} timed steps after {args.warmup} warm-up, "
          f"x{args.rounds} rounds per variant")
    rows = []
    for name in names:
        started = time.perf_counter()
        rows.append(measure(name, args.steps, args.warmup, args.rounds))
        print(f"  measured {name} in {time.perf_counter() - started:.0f} s", flush=True)
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    missed = any(verdict(row) != "ok" for row in rows)
    return 1 if (missed and args.check) else 0


if __name__ == "__main__":
    sys.exit(main())
