"""What the trace's metadata says about the model, the optimizer and the machine."""
from __future__ import annotations

import functools
import os
import platform
import socket
import sys
import time
from typing import Any, Iterable

import torch

from ..trace import schema
from .dispatch import _storage, _tensors


def unique_storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (tied weights counted once)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        for inner in _tensors(tensor, None):
            storage = _storage(inner)
            if storage is not None and inner.device.type != "meta":
                seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())


def module_tree(roots: list[tuple[str, torch.nn.Module]]) -> list[dict[str, Any]]:
    modules = []
    for prefix, root in roots:
        siblings: dict[str, list[str]] = {}
        for path, module in root.named_modules():
            full = ".".join(p for p in (prefix, path) if p)
            own = list(module.parameters(recurse=False))
            entry = schema.ModuleInfo(
                path=full, type=type(module).__name__,
                parameter_bytes=unique_storage_bytes(own),
                parameter_count=sum(p.numel() for p in own),
                buffer_bytes=unique_storage_bytes(module.buffers(recurse=False)),
                total_parameter_bytes=unique_storage_bytes(module.parameters()),
                root=full == prefix,
            )
            modules.append(entry)
            siblings.setdefault(_parent(full), []).append(entry.type)
        # 'repeated': a child of a container whose siblings share its type (transformer
        # layers, ResNet blocks) -- the natural unit for activation checkpointing
        by_path = {m.path: m for m in modules}
        for path, module in root.named_modules():
            full = ".".join(p for p in (prefix, path) if p)
            parent = _parent(full)
            if isinstance(module, torch.nn.Module) and full and full != prefix:
                types = siblings.get(parent, [])
                container = by_path.get(parent)
                if (container is not None and container.type in ("ModuleList", "Sequential")
                        and types.count(by_path[full].type) >= 2):
                    by_path[full].repeated = True
    return [m.__dict__ for m in modules]


def _parent(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ""


def optimizer_info(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    hyper = {}
    for key, value in optimizer.defaults.items():
        if isinstance(value, (int, float, str, bool)) or value is None:
            hyper[key] = value
        elif isinstance(value, (tuple, list)):
            hyper[key] = [v if isinstance(v, (int, float, str, bool)) else str(v) for v in value]
        else:
            hyper[key] = str(value)
    state_tensors = [v for state in optimizer.state.values() for v in state.values()
                     if isinstance(v, torch.Tensor)]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {
        "class": type(optimizer).__name__,
        "module": type(optimizer).__module__,
        "hyperparameters": hyper,
        "param_groups": len(optimizer.param_groups),
        "parameter_count": sum(p.numel() for p in params),
        "state_bytes": unique_storage_bytes(state_tensors),
        "state_tensors_per_parameter": (len(state_tensors) / len(params)) if params else 0,
    }


@functools.cache
def _host() -> tuple[str, str]:
    # platform.processor() runs a subprocess: ask once
    return socket.gethostname(), platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    return {
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "hostname": _host()[0],
        "created_unix_s": time.time(),
        "cwd": os.getcwd(),
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "rank": int(os.environ.get("RANK", "0")),
    }


def device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return _host()[1]


def main_device(roots: list[torch.nn.Module]) -> str:
    for root in roots:
        for param in root.parameters():
            return str(param.device)
    return "cpu"


def argv_of(script: str | None, args: list[str]) -> list[str]:
    return [script or sys.argv[0], *args]
