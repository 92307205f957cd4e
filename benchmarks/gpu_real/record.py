"""Run a training script on a real CUDA GPU and record what its caching allocator did.

    python benchmarks/gpu_real/record.py OUT_PREFIX [--snapshot-step K] SCRIPT [ARGS...]

Nothing of memadvisor is imported here: this is the ground truth its predictions are checked
against.  A global optimizer step post-hook closes each step (every optimizer's step counts
once, as torch counts them): ``max_memory_allocated`` / ``max_memory_reserved`` since the last
step's end, then ``reset_peak_memory_stats``.  Written: ``OUT_PREFIX.json`` (the device, the
torch version, each step's peaks and wall time) and, with ``--snapshot-step K``, a
``torch.cuda.memory._dump_snapshot`` of step K alone (recording starts at step K-1's end, the
dump at step K's end): ``OUT_PREFIX.pickle``.
"""
from __future__ import annotations

import json
import runpy
import sys
import time

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook


def main(argv: list[str]) -> int:
    prefix = argv[0]
    snapshot_step = 0
    rest = argv[1:]
    if rest[:1] == ["--snapshot-step"]:
        snapshot_step = int(rest[1])
        rest = rest[2:]
    script = rest[0]
    steps: list[dict] = []
    started_s = [time.perf_counter()]

    def start_recording() -> None:
        torch.cuda.memory._record_memory_history(max_entries=2_000_000)

    def step_hook(optimizer, args, kwargs) -> None:
        torch.cuda.synchronize()
        now_s = time.perf_counter()
        steps.append({
            "optimizer": type(optimizer).__name__,
            "max_allocated_bytes": torch.cuda.max_memory_allocated(),
            "max_reserved_bytes": torch.cuda.max_memory_reserved(),
            "allocated_bytes": torch.cuda.memory_allocated(),
            "reserved_bytes": torch.cuda.memory_reserved(),
            "wall_s": now_s - started_s[0],
        })
        started_s[0] = now_s
        torch.cuda.reset_peak_memory_stats()
        done = len(steps)
        if snapshot_step and done == snapshot_step - 1:
            start_recording()
        if snapshot_step and done == snapshot_step:
            torch.cuda.memory._dump_snapshot(prefix + ".pickle")
            torch.cuda.memory._record_memory_history(enabled=None)

    register_optimizer_step_post_hook(step_hook)
    if snapshot_step == 1:
        start_recording()
    sys.argv = list(rest)
    sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(script)))
    status = "ok"
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        status = "ok" if stop.code in (None, 0) else f"exit {stop.code}"
    except BaseException as error:  # the record is still written: a crash is a finding
        status = f"{type(error).__name__}: {error}"
    torch.cuda.synchronize()
    record = {
        "script": script, "args": rest[1:], "status": status,
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "capability": list(torch.cuda.get_device_capability()),
        "total_memory_bytes": torch.cuda.get_device_properties(0).total_memory,
        "steps": steps,
        "end_max_allocated_bytes": torch.cuda.max_memory_allocated(),
        "end_max_reserved_bytes": torch.cuda.max_memory_reserved(),
    }
    with open(prefix + ".json", "w") as out:
        json.dump(record, out, indent=1)
    print(f"{script}: {status}, {len(steps)} steps", file=sys.stderr)
    return 0 if status == "ok" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
