"""The compile advice against real ``torch.compile`` runs of the bundled examples.

    OMP_NUM_THREADS=1 python benchmarks/compile_advice.py [--method fake|real] [--larger]
        [NAME ...]

Per example: ``memadvisor profile`` (real CPU, 3 steps) writes the eager trace; the advice
(``memadvisor.advice.compile_saving``) predicts the compiled saved bytes and step peak
from it; the ground truth runs the script with its model compiled by inductor (C++ on this
CPU) for 3 steps (``measure_compiled_run``): the saved bytes at the last backward and the
last step's peak CPU bytes from the native allocator hook, beside the same run eager.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from memadvisor.advice.compile_saving import compile_saving, measure_compiled_run  # noqa: E402

EXAMPLES = ["mlp_regressor", "cnn_classifier", "gpt_lm", "vit_classifier"]
#: --larger: each example a few times its default size (gpt_lm with dropout)
LARGER_ARGS = {
    "mlp_regressor": ["--hidden", "1024", "--depth", "4", "--batch-size", "256"],
    "cnn_classifier": ["--channels", "32", "--image-size", "64", "--batch-size", "32"],
    "gpt_lm": ["--n-layer", "4", "--d-model", "256", "--n-head", "8", "--seq-len", "128",
               "--batch-size", "8", "--dropout", "0.1"],
    "vit_classifier": ["--image-size", "64", "--patch", "8", "--d-model", "192", "--depth",
                       "4", "--heads", "6", "--batch-size", "16"],
}


def error(predicted: int, measured: int) -> str:
    return f"{100.0 * (predicted - measured) / measured:+.2f}%" if measured else "n/a"


def run(name: str, folder: Path, method: str, script_args: list[str]) -> dict:
    trace = folder / f"{name}.trace"
    subprocess.run([sys.executable, "-m", "memadvisor.cli", "profile",
                    str(ROOT / "examples" / f"{name}.py"), "-o", str(trace), "--steps", "3",
                    "-q", "--", *script_args], check=True, cwd=str(ROOT), capture_output=True)
    started = time.monotonic()
    advice = compile_saving(trace, method=method)
    predict_s = time.monotonic() - started
    started = time.monotonic()
    compiled = measure_compiled_run(trace, backend="inductor", steps=3)
    inductor_s = time.monotonic() - started
    eager = measure_compiled_run(trace, backend="eager", steps=3)
    return {"name": name, "advice": advice, "predict_s": predict_s, "inductor_s": inductor_s,
            "compiled": compiled, "eager": eager}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=EXAMPLES)
    parser.add_argument("--method", choices=["fake", "real"], default="fake")
    parser.add_argument("--larger", action="store_true",
                        help="each example at a few times its default size (LARGER_ARGS)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.names) - set(EXAMPLES))
    if unknown:
        parser.error(f"not a bundled example: {unknown[0]} (one of {', '.join(EXAMPLES)})")
    rows = []
    with tempfile.TemporaryDirectory(prefix="compile-advice-") as folder:
        for name in args.names:
            rows.append(run(name, Path(folder), args.method,
                            LARGER_ARGS[name] if args.larger else []))
            print(f"{name}: done", file=sys.stderr, flush=True)
    print(f"saved activations (bytes), prediction on {args.method} tensors against inductor "
          "on this CPU:")
    print("| example | eager saved | predicted compiled | measured compiled | error | "
          "graphs | graph breaks | predict s | inductor run s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        advice, compiled = row["advice"], row["compiled"]
        measured = compiled["saved_bytes"][-1]
        print(f"| {row['name']} | {advice.eager_saved_bytes:,} | "
              f"{advice.compiled_saved_bytes:,} | {measured:,} | "
              f"{error(advice.compiled_saved_bytes, measured)} | {len(advice.graphs)} | "
              f"{sum(advice.graph_breaks.values())} | {row['predict_s']:.1f} | "
              f"{row['inductor_s']:.1f} |")
    print()
    print("CPU bytes (above the script's start) of the analysed step: the eager trace's, the "
          "prediction from it, and the last of 3 steps measured by the native CPU allocator "
          "hook, eager and compiled; first as backward starts, then the step's peak:")
    print("| example | eager trace | predicted compiled | measured eager | measured compiled | "
          "error |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, eager_key, predicted_key, measured_key in (
            ("backward start", "eager_backward_start_bytes", "predicted_backward_start_bytes",
             "backward_start_bytes"),
            ("step peak", "eager_peak_bytes", "predicted_peak_bytes", "step_peak_bytes")):
        for row in rows:
            peak = row["advice"].peak
            measured = row["compiled"][measured_key][-1]
            predicted = getattr(peak, predicted_key)
            print(f"| {row['name']} {label} | {getattr(peak, eager_key):,} | {predicted:,} | "
                  f"{row['eager'][measured_key][-1]:,} | {measured:,} | "
                  f"{error(predicted, measured)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
