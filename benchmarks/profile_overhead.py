"""What profiling costs per training step: memadvisor against no profiler and torch.profiler.

    python benchmarks/profile_overhead.py [--examples gpt_lm,cnn_classifier,mlp_regressor]
        [--steps 8] [--warmup 2] [--rounds 2] [--check]

Each bundled example runs at a realistic CPU size, in this one process, under three
variants: ``plain`` (nothing attached), ``memadvisor`` (a ``ProfileSession``, as
``memadvisor profile`` runs it) and ``torch.profiler`` (``profile_memory=True,
with_stack=True``, the closest built-in tool).  Every variant runs the example's own
``main()`` with the same arguments and seed, and the variants take turns (``--rounds``
times) so that a machine getting busier or quieter affects them alike.

A step is timed by a global optimizer step post-hook that records ``time.perf_counter()``
(and ``time.process_time()``): a step's time is the gap between two optimizer steps.  The
first ``--warmup`` steps of each run are dropped; the figure is the median over the
remaining steps of all rounds.  Columns: median wall ms per step of each variant, the wall
ratios to plain, the same ratios in CPU time (steadier where other programs share the
machine), and the events memadvisor recorded per step.  Work
done when a profiler stops (torch.profiler's post-processing, memadvisor's trace building)
is not part of any step and is not counted.

The target is memadvisor <= 1.3x plain on the GPT example, and below torch.profiler's
overhead everywhere; ``--check`` exits 1 when it is missed.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
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
VARIANTS = ("plain", "memadvisor", "torch.profiler")
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
    if name == "plain":
        yield
    elif name == "memadvisor":
        from memadvisor.profile import ProfileSession

        session = ProfileSession()  # no step limit: the example runs all its steps
        with session:
            yield
        info["events"] = len(session.recorder.rows)
    elif name == "torch.profiler":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                     with_stack=True):
            yield
    else:
        raise ValueError(name)


def time_variant(example, args: list[str], variant: str, steps: int, warmup: int) -> dict:
    info: dict = {}
    argv = [*args, "--steps", str(warmup + steps), "--log-every", "1000000", "--seed", "0"]
    with StepClock() as clock, contextlib.redirect_stdout(io.StringIO()):
        with _variant(variant, info):
            example.main(argv)
    info["step_times_s"] = clock.step_times_s(warmup)
    info["step_cpu_s"] = clock.step_times_s(warmup, clock=1)
    return info


def measure(name: str, steps: int, warmup: int, rounds: int) -> dict:
    example = load_example(name)
    wall = {variant: [] for variant in VARIANTS}
    cpu = {variant: [] for variant in VARIANTS}
    events = 0
    for _ in range(rounds):
        for variant in VARIANTS:
            info = time_variant(example, EXAMPLE_ARGS[name], variant, steps, warmup)
            wall[variant].extend(info["step_times_s"])
            cpu[variant].extend(info["step_cpu_s"])
            events = info.get("events", events)
    median_ms = {v: 1000 * statistics.median(t) for v, t in wall.items()}
    cpu_ms = {v: 1000 * statistics.median(t) for v, t in cpu.items()}
    return {
        "example": name,
        "median_ms": median_ms,
        "median_cpu_ms": cpu_ms,
        "memadvisor_ratio": median_ms["memadvisor"] / median_ms["plain"],
        "torch_profiler_ratio": median_ms["torch.profiler"] / median_ms["plain"],
        "memadvisor_cpu_ratio": cpu_ms["memadvisor"] / cpu_ms["plain"],
        "torch_profiler_cpu_ratio": cpu_ms["torch.profiler"] / cpu_ms["plain"],
        "steps_timed": {v: len(t) for v, t in wall.items()},
        "memadvisor_events_per_step": events / (warmup + steps),
    }


def verdict(row: dict) -> str:
    problems = []
    if row["example"] == "gpt_lm" and row["memadvisor_ratio"] > GPT_TARGET_RATIO:
        problems.append(f"memadvisor > {GPT_TARGET_RATIO}x")
    if row["memadvisor_ratio"] >= row["torch_profiler_ratio"]:
        problems.append("not below torch.profiler")
    return "MISSED: " + ", ".join(problems) if problems else "ok"


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
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when a target is missed")
    args = parser.parse_args(argv)
    names = [n for n in args.examples.split(",") if n]
    unknown = [n for n in names if n not in EXAMPLE_ARGS]
    if unknown:
        parser.error(f"unknown examples: {', '.join(unknown)}")

    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{args.steps} timed steps after {args.warmup} warm-up, x{args.rounds} rounds; "
          "median ms per step")
    header = (f"{'example':<15} {'plain':>8} {'memadv.':>8} {'torch.p':>8} "
              f"{'ma/plain':>9} {'tp/plain':>9} {'cpu ma/pl':>10} {'cpu tp/pl':>10} "
              f"{'events/step':>12}  verdict")
    print(header)
    print("-" * len(header))
    missed = False
    for name in names:
        row = measure(name, args.steps, args.warmup, args.rounds)
        ms = row["median_ms"]
        result = verdict(row)
        missed |= result != "ok"
        print(f"{name:<15} {ms['plain']:>8.1f} {ms['memadvisor']:>8.1f} "
              f"{ms['torch.profiler']:>8.1f} {row['memadvisor_ratio']:>8.2f}x "
              f"{row['torch_profiler_ratio']:>8.2f}x {row['memadvisor_cpu_ratio']:>9.2f}x "
              f"{row['torch_profiler_cpu_ratio']:>9.2f}x "
              f"{row['memadvisor_events_per_step']:>12.0f}  {result}", flush=True)
    return 1 if (missed and args.check) else 0


if __name__ == "__main__":
    sys.exit(main())
