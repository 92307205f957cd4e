"""The allocator model against real GPUs: every snapshot in ../shared/gpu-truth imported,
its recorded stream replayed through memadvisor's model of the CUDA caching allocator.

    python benchmarks/gpu_truth_allocator.py [FOLDER]

Prints, per snapshot: the recorded peak reserved bytes and segment count at the dump, the
model's from the recorded starting state (the segments and blocks alive when recording
began) and from a cold start (nothing cached: what the warm-up history is worth), and the
peak allocated (block sizes).  The K files carry no licence: they are read here, where they
are, and never copied into the project; absent files are named and skipped.
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from memadvisor.simulate.recorded_state import replay_recorded
from memadvisor.snapshot.importer import import_snapshot
from memadvisor.trace import read_trace

DEFAULT_FOLDER = Path(__file__).resolve().parents[2] / "shared" / "gpu-truth"
NAMES = ["W_medium_128_training", "W_medium_512_training", "W_medium_1024_training",
         "K_memory_ctx128_fullstep", "K_memory_ctx128_forward"]
MIB = 2**20


def main(folder: Path) -> int:
    print(f"{'snapshot':<28}{'requests':>9}{'reserved MiB':>14}{'model':>10}{'err':>8}"
          f"{'cold':>10}{'err':>8}{'segments':>10}{'model':>7}{'cold':>6}"
          f"{'peak alloc MiB':>16}{'model':>11}{'import s':>10}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in NAMES:
            path = folder / f"{name}.pickle"
            if not path.is_file():
                print(f"{name:<28} absent ({path}): skipped")
                continue
            start = time.perf_counter()
            out = Path(tmp) / f"{name}.trace"
            import_snapshot(path, out)
            elapsed_s = time.perf_counter() - start
            trace = read_trace(out)
            warm, cold = replay_recorded(trace), replay_recorded(trace, cold_start=True)
            print(f"{name:<28}{warm.requests:>9}"
                  f"{warm.recorded_peak_reserved_bytes / MIB:>14,.0f}"
                  f"{warm.modelled_peak_reserved_bytes / MIB:>10,.0f}{warm.reserved_error:>+8.2%}"
                  f"{cold.modelled_peak_reserved_bytes / MIB:>10,.0f}{cold.reserved_error:>+8.2%}"
                  f"{warm.recorded_segments:>10}{warm.modelled_segments:>7}"
                  f"{cold.modelled_segments:>6}"
                  f"{warm.recorded_peak_allocated_bytes / MIB:>16,.1f}"
                  f"{warm.modelled_peak_allocated_bytes / MIB:>11,.1f}{elapsed_s:>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_FOLDER))
