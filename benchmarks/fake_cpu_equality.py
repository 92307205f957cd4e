"""Fake CPU tensors against the real CPU run, for every bundled example (issue 10's second
Done-when item).

    python benchmarks/fake_cpu_equality.py                    # all four examples, 3 steps
    python benchmarks/fake_cpu_equality.py --examples gpt_lm --steps 2 --json out.json
    python benchmarks/fake_cpu_equality.py --probes           # real run with the bf16 probes

For each example (``examples/NAME.py`` with its default, small arguments and ``--seed 0``,
as ``.ci/run`` profiles them) two traces are recorded:

* real: ``memadvisor profile EXAMPLE --steps N --engine native --no-probes -q``: the
  native engine follows c10's CPU allocator, so it also sees blocks kernels allocate for
  themselves (oneDNN / ATen scratch), recorded with dtype ``bytes``;
* fake: ``memadvisor profile --fake EXAMPLE --steps N`` without ``--gpu``: every tensor is
  a fake CPU tensor (dispatch engine); no kernel runs, so no scratch exists.

Per step (the trace's ``step`` column; live bytes over the whole run, summed as
``memadvisor.trace.analysis.live_bytes`` does over ``size_bytes``): the real peak, the real
peak without the ``bytes`` rows (tensor level), the fake peak, fake - real tensor peak
(issue 10: 0), real - fake, and the raw kernel bytes alive at the real peak (real - fake
equals them when the real peak is a tensor peak with scratch on top).  Where the tensor
peaks differ, the allocations one trace has and the other lacks are listed (op, dtype,
shape, bytes, phase, source line), which names the cause.  Exit status 1 when a tensor
peak differs.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = ("gpt_lm", "cnn_classifier", "mlp_regressor", "vit_classifier")


def profile(example: str, steps: int, work: Path, fake: bool, probes: bool,
            script_args: list[str]) -> Path:
    script = REPO / "examples" / f"{example}.py"
    trace = work / f"{example}.{'fake' if fake else 'real'}.trace"
    options = (["--fake"] if fake else
               ["--engine", "native", *([] if probes else ["--no-probes"])])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    env.pop("CUBLAS_WORKSPACE_CONFIG", None)
    command = [sys.executable, "-m", "memadvisor.cli", "profile", *options, str(script),
               "-o", str(trace), "--steps", str(steps), "-q", "--", *script_args]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=work, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({proc.returncode}):\n"
                         f"{proc.stderr[-4000:]}")
    return trace


def _live(events) -> np.ndarray:
    sizes = events["size_bytes"].to_numpy(dtype=np.int64)
    signed = np.where((events["action"] == "alloc").to_numpy(), sizes, -sizes)
    return np.cumsum(signed)


def step_rows(real_events, fake_events) -> list[dict]:
    live_all = _live(real_events)
    kernel = (real_events["dtype"] == "bytes").to_numpy()
    sizes = real_events["size_bytes"].to_numpy(dtype=np.int64)
    signed = np.where((real_events["action"] == "alloc").to_numpy(), sizes, -sizes)
    live_kernel = np.cumsum(np.where(kernel, signed, 0))
    live_tensor = live_all - live_kernel
    live_fake = _live(fake_events)
    real_steps = real_events["step"].to_numpy()
    fake_steps = fake_events["step"].to_numpy()
    rows = []
    for step in sorted(set(real_steps.tolist()) | set(fake_steps.tolist())):
        r = np.flatnonzero(real_steps == step)
        f = np.flatnonzero(fake_steps == step)
        if not len(r) or not len(f):
            rows.append({"step": step, "missing": "real" if not len(r) else "fake"})
            continue
        at = r[int(np.argmax(live_all[r]))]
        tensor_at = r[int(np.argmax(live_tensor[r]))]
        fake_at = f[int(np.argmax(live_fake[f]))]
        rows.append({
            "real_tensor_peak_at": int(tensor_at), "fake_peak_at": int(fake_at),
            "step": int(step),
            "real_peak": int(live_all[at]),
            "real_tensor_peak": int(live_tensor[r].max()),
            "fake_peak": int(live_fake[f].max()),
            "kernel_at_real_peak": int(live_kernel[at]),
            "tensor_at_real_peak": int(live_tensor[at]),
            "kernel_blocks_in_step": int(((real_events["action"].to_numpy()[r] == "alloc")
                                          & kernel[r]).sum()),
            "kernel_max_block": int(sizes[r][kernel[r]].max()) if kernel[r].any() else 0,
        })
    return rows


def live_rows(events, upto: int, tensors_only: bool) -> collections.Counter:
    """(op, dtype, shape, bytes) of the storages alive just after event ``upto``."""
    alive = {}
    part = events.iloc[:upto + 1]
    for action, sid, op, dtype, shape, size in zip(
            part["action"], part["storage_id"], part["op"].astype(str),
            part["dtype"].astype(str), part["shape"].astype(str), part["size_bytes"]):
        if action == "alloc":
            if not (tensors_only and dtype == "bytes"):
                alive[sid] = (op, dtype, shape, int(size))
        else:
            alive.pop(sid, None)
    return collections.Counter(alive.values())


def _allocations(events):
    rows = events[(events["action"] == "alloc") & (events["dtype"] != "bytes")]
    return collections.Counter(zip(rows["op"].astype(str), rows["dtype"].astype(str),
                                   rows["shape"].astype(str), rows["size_bytes"].astype(int),
                                   rows["phase"].astype(str), rows["step"].astype(int),
                                   rows["source_line"].astype(str)))


def differences(real_events, fake_events, limit: int = 12) -> tuple[list, list]:
    real, fake = _allocations(real_events), _allocations(fake_events)
    only_real = sorted((real - fake).items(), key=lambda kv: -kv[0][3] * kv[1])
    only_fake = sorted((fake - real).items(), key=lambda kv: -kv[0][3] * kv[1])
    return only_real[:limit], only_fake[:limit]


def _wrapped_scalar_bytes(counter: collections.Counter) -> int:
    """Bytes of 0-dim 8-byte float64/int64 storages among (op, dtype, shape, bytes) keys, as
    torch makes for a Python number wrapped into a CPU op."""
    return sum(key[3] * count for key, count in counter.items()
               if key[1] in ("float64", "int64") and key[2] == "" and key[3] == 8)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", default=",".join(EXAMPLES))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--probes", action="store_true",
                        help="real run with the bf16 probes (default --no-probes)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from memadvisor.trace.io import read_trace

    table, failed = [], False
    detail = []
    with tempfile.TemporaryDirectory(prefix="fake-cpu-") as folder:
        work = Path(folder)
        for example in args.examples.split(","):
            script_args = ["--seed", "0"]
            t0 = time.perf_counter()
            real_trace = read_trace(profile(example, args.steps, work, False, args.probes,
                                            script_args))
            t1 = time.perf_counter()
            fake_trace = read_trace(profile(example, args.steps, work, True, False,
                                            script_args))
            t2 = time.perf_counter()
            real_events, fake_events = real_trace.events, fake_trace.events
            devices = sorted(set(fake_events["device"].astype(str)))
            for row in step_rows(real_events, fake_events):
                row["example"] = example
                row["wrapped_scalars_at_real_peak"] = 0
                table.append(row)
            at_peak = []
            for row in table:
                if row["example"] != example or "missing" in row \
                        or row["fake_peak"] == row["real_tensor_peak"]:
                    continue
                real_live = live_rows(real_events, row["real_tensor_peak_at"], True)
                fake_live = live_rows(fake_events, row["fake_peak_at"], False)
                real_more, fake_more = real_live - fake_live, fake_live - real_live
                # ATen wraps a Python number used with a CPU tensor (``t / 0.9``) in an
                # 8-byte 0-dim float64/int64 tensor inside the op: memory the native hook
                # sees being made and a fake run never materialises -- kernel-level, like
                # the raw blocks, and reported as such
                row["wrapped_scalars_at_real_peak"] = _wrapped_scalar_bytes(real_more) \
                    - _wrapped_scalar_bytes(fake_more)
                at_peak.append((row["step"], sorted(real_more.items()),
                                sorted(fake_more.items())))
            for row in table:
                if row["example"] == example and "missing" not in row and row["fake_peak"] \
                        + row["wrapped_scalars_at_real_peak"] != row["real_tensor_peak"]:
                    failed = True
            only_real, only_fake = differences(real_events, fake_events)
            detail.append((example, t1 - t0, t2 - t1, devices, only_real, only_fake,
                           real_trace.meta.steps_completed, fake_trace.meta.steps_completed,
                           at_peak))

    print(f"fake CPU tensors (`profile --fake`, no --gpu) against the real run "
          f"(`profile --engine native{'' if args.probes else ' --no-probes'}`), "
          f"{args.steps} steps, script args --seed 0; bytes")
    print()
    print("| example | step | real peak | real tensor peak (no `bytes` rows) | fake peak | "
          "fake - real tensor | real - fake | kernel bytes alive at real peak | "
          "wrapped Python scalars at real peak | "
          "tensor bytes alive at real peak | kernel blocks in step (largest) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in table:
        if "missing" in row:
            print(f"| {row['example']} | {row['step']} | no {row['missing']} rows |"
                  " | | | | | | | |")
            continue
        print(f"| {row['example']} | {row['step']} | {row['real_peak']:,} | "
              f"{row['real_tensor_peak']:,} | {row['fake_peak']:,} | "
              f"{row['fake_peak'] - row['real_tensor_peak']:+,} | "
              f"{row['real_peak'] - row['fake_peak']:+,} | {row['kernel_at_real_peak']:,} | "
              f"{row['wrapped_scalars_at_real_peak']:,} | {row['tensor_at_real_peak']:,} | "
              f"{row['kernel_blocks_in_step']} ({row['kernel_max_block']:,}) |")
    print()
    for (example, real_s, fake_s, devices, only_real, only_fake, real_done, fake_done,
         at_peak) in detail:
        print(f"{example}: real {real_s:.1f} s, fake {fake_s:.1f} s; steps completed "
              f"{real_done} / {fake_done}; fake devices {devices}")
        for step, real_more, fake_more in at_peak:
            print(f"  step {step}: storages alive at the real tensor peak and not at the "
                  f"fake peak (op, dtype, shape, bytes: count): {real_more}; the other way: "
                  f"{fake_more}")
        for label, items in (("only in the real trace", only_real),
                             ("only in the fake trace", only_fake)):
            if items:
                print(f"  tensor allocations {label} (op, dtype, shape, bytes, phase, "
                      f"step, line: count):")
                for key, count in items:
                    print(f"    {key}: {count}")
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1))
    if failed:
        print("a tensor-level peak differs by more than the wrapped Python scalars",
              file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
