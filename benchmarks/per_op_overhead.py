"""What following one aten op costs: memadvisor's engines against torch.profiler.

    python benchmarks/per_op_overhead.py [--ops 20000] [--rounds 5] [--elements 16]

One op, ``a + b`` on small float tensors (each call allocates its result and frees the
previous one, so both the op callbacks and the allocator hooks are on the path), timed in
this process's CPU time (steadier than wall time where other programs share the machine),
per op, under each variant: ``plain`` (nothing attached), ``native`` (memadvisor's native
engine, the default without a GPU), ``dispatch`` (memadvisor's Python dispatch-mode engine,
the one used with a GPU) and ``torch.profiler`` (``profile_memory=True, with_stack=True``,
the closest built-in tool, which also follows every op and allocation).  The variants take
turns for ``--rounds`` rounds so a machine getting busier affects them alike; the figure is
the median per-op time over the rounds, the overhead is that minus plain's.

Target (issue 16): the native engine's per-op overhead at or below torch.profiler's;
``--check`` exits 1 when it is missed.  Figures, and what the engine spends per op:
docs/VALIDATION.md ("Per-op overhead").  ``MEMADVISOR_NATIVE_SRC`` (a folder holding other
``op_tracker.cpp`` / ``allocator_hook.cpp``) measures another version of the engine.  One thread (``torch.set_num_threads(1)``): an op this
small never uses more, and idle OpenMP workers spinning would blur the clock.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

VARIANTS = ("plain", "native", "dispatch", "torch.profiler")


@contextlib.contextmanager
def attached(variant: str):
    if variant == "plain":
        yield
    elif variant in ("native", "dispatch"):
        from memadvisor.profile import ProfileSession
        session = ProfileSession(engine=variant, probes=False)
        with session:
            yield
        if session.engine != variant:
            raise SystemExit(f"the {variant} engine did not run here: {session.engine_status}")
    else:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True):
            yield


def time_per_op_s(variant: str, ops: int, elements: int) -> float:
    a, b = torch.randn(elements), torch.randn(elements)
    with attached(variant):
        for _ in range(min(ops, 1000)):  # warm up: first-call caches, callback setup
            c = a + b
        started = time.process_time()
        for _ in range(ops):
            c = a + b
        spent = time.process_time() - started
    del c
    return spent / ops


def measure(ops: int, rounds: int, elements: int) -> dict[str, float]:
    samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(rounds):
        for variant in VARIANTS:
            samples[variant].append(time_per_op_s(variant, ops, elements))
    return {v: statistics.median(s) for v, s in samples.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--elements", type=int, default=16)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    per_op = measure(args.ops, args.rounds, args.elements)
    plain = per_op["plain"]
    print(f"a + b on {args.elements} floats, {args.ops} ops x {args.rounds} rounds, CPU time, "
          f"torch {torch.__version__}")
    print(f"{'variant':<16}{'us/op':>10}{'overhead us/op':>16}")
    for variant in VARIANTS:
        print(f"{variant:<16}{per_op[variant] * 1e6:>10.2f}"
              f"{(per_op[variant] - plain) * 1e6:>16.2f}")
    native, reference = per_op["native"] - plain, per_op["torch.profiler"] - plain
    met = native <= reference
    print(f"native engine overhead {native * 1e6:.2f} us/op vs torch.profiler "
          f"{reference * 1e6:.2f} us/op: {'met' if met else 'NOT met'}")
    return 0 if met or not args.check else 1


if __name__ == "__main__":
    sys.exit(main())
