"""Fake execution against real GPU snapshots: `profile --fake` of the programs that wrote them.

    python benchmarks/gpu_truth/compare_fake.py [--k] [--work DIR] [--contexts 128,512,1024]

For each W snapshot (W_medium_{128,512,1024}_training.pickle, recorded on an sm80-class GPU:
cuBLAS workspaces of 8,519,680 B):

1. ``memadvisor import-snapshot`` -> the recorded trace; ``summary --json`` gives the
   recorded step's peak allocated (``peak_bytes``, allocator blocks) and the recorded peak
   reserved (``reserved_bytes``);
2. ``memadvisor profile --fake --gpu a100-40gb w_medium.py --steps 0`` (all 6 steps:
   5 warm-up + the recorded one; ctx 512 and 1024 with ``--autocast``, as recorded);
3. the fake trace's device rows through the caching-allocator model over the whole run
   (``model_whole_run``): the last step's peak allocated and peak reserved.

``--k`` adds the K fullstep snapshot (3.4B parameters, first step, Hopper: ``--gpu
h100-80gb``), whose peak reserved is 58,280 MiB.  Targets: peak allocated within 2%,
peak reserved within 3%.  Also prints, per context, the recorded step's allocation sizes
the fake run lacks or adds (rounded to 512 B, blocks alive at the start excluded).
"""
from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # this checkout's memadvisor

TRUTH = HERE.parents[2] / "shared" / "gpu-truth"
CASES = {  # name -> (snapshot, script, script args, --gpu)
    "W ctx 128": ("W_medium_128_training.pickle", "w_medium.py",
                  ["--context-length", "128"], "a100-40gb"),
    "W ctx 512": ("W_medium_512_training.pickle", "w_medium.py",
                  ["--context-length", "512", "--autocast"], "a100-40gb"),
    "W ctx 1024": ("W_medium_1024_training.pickle", "w_medium.py",
                   ["--context-length", "1024", "--autocast"], "a100-40gb"),
    "K fullstep": ("K_memory_ctx128_fullstep.pickle", "k_fullstep.py", [], "h100-80gb"),
}
TARGETS = {"allocated": 0.02, "reserved": 0.03}


def _memadvisor(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "memadvisor.cli", *args],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"memadvisor {' '.join(args)}: {proc.stderr.strip()[-500:]}")
    return proc.stdout


def recorded(snapshot: Path, work: Path) -> dict:
    trace = work / f"{snapshot.stem}.real.trace"
    _memadvisor("import-snapshot", str(snapshot), "-o", str(trace))
    summary = json.loads(_memadvisor("summary", str(trace), "--json"))
    return {"trace": trace, "allocated": summary["peak_bytes"],
            "reserved": summary["reserved_bytes"]}


def predicted(script: str, args: list[str], gpu: str, work: Path, name: str) -> dict:
    from memadvisor.commands.profile_fake import modelled_step_peaks
    from memadvisor.gpus import gpu_profile
    trace = work / f"{name.replace(' ', '_')}.fake.trace"
    started = time.monotonic()
    _memadvisor("profile", "--fake", "--gpu", gpu, str(HERE / script), "-o", str(trace),
                "--steps", "0", "-q", "--", *args)
    seconds = time.monotonic() - started
    steps, _ = modelled_step_peaks(trace, "cuda:0", gpu_profile(gpu).total_memory_bytes)
    from memadvisor.trace.io import read_meta
    last = read_meta(trace).steps_completed - 1  # the recorded step is the run's last
    peaks = next(p for p in steps if p.step == last)
    return {"trace": trace, "allocated": peaks.peak_allocated_bytes,
            "reserved": peaks.peak_reserved_bytes, "step": last, "seconds": seconds}


def size_differences(real_trace: Path, fake_trace: Path, step: int, top: int = 6) -> tuple:
    """(sizes only the real step allocates, sizes only the fake step allocates), as
    Counters of 512-rounded sizes, largest total bytes first."""
    from memadvisor.simulate.allocator import round_size
    from memadvisor.trace.io import read_trace
    real = read_trace(real_trace)
    recorded_rows = real.events.iloc[int(real.meta.allocator["initial_blocks"]):]
    real_sizes = collections.Counter(
        recorded_rows[recorded_rows.action == "alloc"].size_bytes.map(round_size))
    fake = read_trace(fake_trace).events
    fake = fake[(fake.device == "cuda:0") & (fake.step == step) & (fake.action == "alloc")]
    fake_sizes = collections.Counter(fake.size_bytes.map(round_size))

    def largest(counter):
        return sorted(counter.items(), key=lambda item: -item[0] * item[1])[:top]
    return largest(real_sizes - fake_sizes), largest(fake_sizes - real_sizes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", action="store_true", help="also the K fullstep snapshot")
    parser.add_argument("--contexts", default="128,512,1024")
    parser.add_argument("--work", default="gpu_truth_fake", help="folder for the traces")
    options = parser.parse_args(argv)
    work = Path(options.work)
    work.mkdir(parents=True, exist_ok=True)
    names = [f"W ctx {c}" for c in options.contexts.split(",") if c]
    names += ["K fullstep"] if options.k else []
    rows = []
    for name in names:
        snapshot, script, args, gpu = CASES[name]
        real = recorded(TRUTH / snapshot, work)
        fake = predicted(script, args, gpu, work, name)
        rows.append((name, gpu, real, fake))
        missing, added = size_differences(real["trace"], fake["trace"], fake["step"])
        print(f"{name}: fake run {fake['seconds']:.0f} s; sizes only recorded "
              f"{missing}; only fake {added}", file=sys.stderr)
    print("| case | --gpu | peak allocated recorded | predicted | error | "
          "peak reserved recorded | predicted | error |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    worst = 0.0
    for name, gpu, real, fake in rows:
        cells = []
        for key in ("allocated", "reserved"):
            error = fake[key] / real[key] - 1
            worst = max(worst, abs(error) / TARGETS[key])
            cells += [f"{real[key]:,}", f"{fake[key]:,}", f"{error:+.2%}"]
        print(f"| {name} | {gpu} | " + " | ".join(cells) + " |")
    return 0 if worst <= 1 else 1


if __name__ == "__main__":
    sys.exit(main())
