"""What a snapshot's stack frames tell about one allocation: phase, op, user source line.

Snapshots recorded with ``stacks="all"`` hold C++ and Python frames, innermost first;
with ``stacks="python"`` only Python frames; without stacks, none (then everything here
answers "unknown").  Autograd's backward runs in the engine's own thread, so its
allocations show ``Engine::thread_main`` and no Python frames; optimizer steps are a
Python ``step`` inside an optimizer file (or inside the ``Optimizer.step`` annotations the
recorder added); forward is a module's ``forward`` or ``_call_impl``.
"""
from __future__ import annotations

import json
import re

from ..trace import schema

_OP_CALL = re.compile(r"at::_ops::(\w+)::call\b")
_BACKWARD_NODE = re.compile(r"torch::autograd::generated::(\w+)::apply\b")
#: ops that only hand out memory for the op that called them
_ALLOCATING_OPS = {"empty", "empty_memory_format", "empty_strided", "empty_like", "new_empty",
                   "new_empty_strided", "zeros_like", "resize_", "set_"}
#: path fragments of frames that belong to libraries, not to the user's code
_LIBRARY_PATHS = ("/torch/", "/site-packages/", "/dist-packages/", "/lib/python3",
                  "<frozen", "/einops/", "/einx/")
CUBLAS_WORKSPACE_OP = "cublas_workspace"


def python_frames(frames: list[dict]) -> list[dict]:
    return [f for f in frames if str(f.get("filename", "")).endswith(".py")]


def is_cublas_workspace(frames: list[dict]) -> bool:
    # CublasHandlePool.cpp's getNewWorkspace: allocated through the caching allocator, kept
    return any("getNewWorkspace" in f.get("name", "") or "getCUDABlasLtWorkspace"
               in f.get("name", "") for f in frames)


def phase_of(frames: list[dict], time_us: int | None, optimizer_windows) -> str:
    if not frames:
        return schema.OTHER_PHASE
    names = [f.get("name", "") for f in frames]
    if any("torch::autograd::Engine::thread_main" in n or "Engine::evaluate_function" in n
           for n in names):
        return schema.BACKWARD
    if time_us is not None and any(start <= time_us <= end for start, end in optimizer_windows):
        return schema.OPTIMIZER
    py = python_frames(frames)
    for f in py:
        name, path = f.get("name", ""), f.get("filename", "")
        if name == "backward" and ("/torch/" in path or "autograd" in path):
            return schema.BACKWARD
        if name in ("step", "_single_tensor_adamw", "_multi_tensor_adamw", "_fused_adamw") \
                and "optim" in path.rsplit("/", 1)[-1] + path:
            return schema.OPTIMIZER
    if any(f.get("name") in ("forward", "_call_impl") for f in py):
        return schema.FORWARD
    return schema.OTHER_PHASE


def op_of(frames: list[dict]) -> str:
    if is_cublas_workspace(frames):
        return CUBLAS_WORKSPACE_OP
    for f in frames:
        match = _OP_CALL.search(f.get("name", ""))
        if match and match.group(1) not in _ALLOCATING_OPS:
            return f"aten::{match.group(1)}"
    for f in frames:
        match = _BACKWARD_NODE.search(f.get("name", ""))
        if match:
            return match.group(1)
    return ""


def user_frame(frames: list[dict]) -> tuple[str, int, str]:
    """(file, line, function) of the innermost frame in the user's code ('' if none)."""
    py = python_frames(frames)
    for f in py:
        path = str(f.get("filename", ""))
        if not any(part in path for part in _LIBRARY_PATHS):
            return path, int(f.get("line", 0) or 0), str(f.get("name", ""))
    if py:
        f = py[0]
        return str(f.get("filename", "")), int(f.get("line", 0) or 0), str(f.get("name", ""))
    return "", 0, ""


def optimizer_windows(snapshot: dict, device: int) -> list[tuple[int, int]]:
    """(start_us, end_us) of each ``Optimizer.step`` annotation the recorder made."""
    windows, open_at = [], None
    for note in snapshot.get("external_annotations") or []:
        if not isinstance(note, dict) or note.get("device", device) != device:
            continue
        if "Optimizer.step" not in str(note.get("name", "")):
            continue
        if note.get("stage") == "START":
            open_at = note.get("time_us")
        elif note.get("stage") == "END" and open_at is not None:
            windows.append((open_at, note.get("time_us")))
            open_at = None
    return windows


#: a frame memadvisor adds to the snapshots it writes, carrying what the trace knew about
#: the block (memory_viz shows it as the innermost frame); read back on import
TAG_FILE = "<memadvisor>"
TAG_KEYS = ("category", "phase", "op", "module", "step", "dtype", "shape")


def tag_frame(fields: dict) -> dict:
    return {"filename": TAG_FILE, "line": 0,
            "name": "memadvisor " + json.dumps({k: fields[k] for k in TAG_KEYS if k in fields},
                                               separators=(",", ":"))}


def read_tag(frames: list[dict]) -> dict:
    for f in frames:
        if f.get("filename") == TAG_FILE:
            try:
                tag = json.loads(str(f.get("name", "")).split(" ", 1)[1])
            except (IndexError, ValueError):
                return {}
            return tag if isinstance(tag, dict) else {}
    return {}
