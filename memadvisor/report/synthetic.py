"""Synthetic traces of any size, for the report tests and benchmarks (no torch needed).

The events follow a real training step's shape: parameters made during setup, then per
step an input batch, a forward that saves activations per module (with short-lived
temporaries around them), a backward that frees them in reverse while making gradients, an
optimizer step that makes its state on the first step, and ``zero_grad`` freeing the
gradients.  Sizes are chosen so the peak falls at the end of the forward, as it does for
most models.

``hostile=True`` names one module ``<script>alert(1)</script>`` (with the largest
activations, so it shows in every per-module table) and gives it a source file whose name
is HTML too: readers that forget to escape are caught by the tests.
"""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from ..trace import schema
from ..trace.io import events_table, write_trace

HOSTILE_MODULE = "<script>alert(1)</script>"
HOSTILE_FILE = "<img src=x onerror=alert(2)>.py"
MIB = 1024**2


class _Events:
    """Column lists plus the bookkeeping of a running trace (time, step, phase)."""

    def __init__(self):
        self.columns = {name: [] for name in schema.COLUMN_NAMES}
        self.next_id = 0
        self.time_ns = 0
        self.step = 0
        self.phase = schema.OTHER_PHASE

    def alloc(self, size_bytes: int, category: str, module: str, op: str,
              source: tuple[str, int, str]) -> int:
        storage_id = self.next_id
        self.next_id += 1
        self._add(schema.ALLOC, storage_id, size_bytes, category, module, op, source)
        return storage_id

    def free(self, storage_id: int, size_bytes: int, category: str, module: str, op: str,
             source: tuple[str, int, str]) -> None:
        self._add(schema.FREE, storage_id, size_bytes, category, module, op, source)

    def _add(self, action, storage_id, size_bytes, category, module, op, source):
        c = self.columns
        c["seq"].append(len(c["seq"]))
        self.time_ns += 1_000
        c["time_ns"].append(self.time_ns)
        c["action"].append(action)
        c["storage_id"].append(storage_id)
        c["size_bytes"].append(int(size_bytes))
        c["device"].append("cuda:0")
        c["dtype"].append("float32")
        c["shape"].append(str(size_bytes // 4))
        c["category"].append(category)
        c["op"].append(op)
        c["module"].append(module)
        c["phase"].append(self.phase)
        c["step"].append(self.step)
        c["source_file"].append(source[0])
        c["source_line"].append(source[1])
        c["source_function"].append(source[2])


def _layer_modules(layers: int, hostile: bool) -> list[str]:
    names = []
    for i in range(layers):
        attn = HOSTILE_MODULE if (hostile and i == 0) else f"blocks.{i}.attn"
        names += [attn, f"blocks.{i}.mlp.fc", f"blocks.{i}.mlp.act"]
    return names


def make_events(events: int = 10_000, *, steps: int = 3, layers: int = 8,
                activation_scale: float = 1.0, hostile: bool = True,
                all_categories: bool = False) -> tuple[dict[str, list], list[dict]]:
    """Column lists of about ``events`` events, and the per-step info for the metadata."""
    modules = _layer_modules(layers, hostile)
    model_file = ("model.py", 40, "forward")
    act_size = int(2 * MIB * activation_scale)
    param_size = 1 * MIB
    # events per module per step without temporaries: activation alloc+free, gradient
    # alloc+free (zero_grad), two optimizer temporaries
    fixed = 2 + 2 + 2
    per_module = max(events / max(steps, 1) / len(modules), fixed)
    temporaries = max(int(round((per_module - fixed) / 4)), 0)  # fwd+bwd pairs each

    ev = _Events()

    def source_of(module: str, line: int) -> tuple[str, int, str]:
        if module == HOSTILE_MODULE:
            return (HOSTILE_FILE, line, "forward")
        return (model_file[0], line, model_file[2])

    for _module in modules:
        ev.alloc(param_size, schema.PARAMETER, "", "aten::empty", ("model.py", 12, "__init__"))
    if all_categories:  # the categories a plain fp32 model does not have, for worst cases
        ev.alloc(MIB // 2, schema.OTHER, "", "", ("", 0, ""))
        ev.alloc(MIB // 4, schema.BUFFER, modules[0], "aten::zeros", ("model.py", 14,
                                                                      "__init__"))
    grads: dict[str, int] = {}
    state: dict[str, list[int]] = {}
    step_info = []
    for step in range(steps):
        ev.step, ev.phase = step, schema.OTHER_PHASE
        start_ns = ev.time_ns
        for module, grad in grads.items():  # zero_grad(set_to_none=True)
            ev.free(grad, param_size, schema.GRADIENT, "", "", ("train.py", 30, "main"))
        grads = {}
        batch = ev.alloc(256 * 1024, schema.INPUT, "", "aten::to", ("train.py", 32, "main"))

        ev.phase = schema.FORWARD
        saved, casts = [], []
        for index, module in enumerate(modules):
            size = act_size * 3 // 2 if module == HOSTILE_MODULE else act_size
            for _ in range(temporaries):
                t = ev.alloc(act_size // 2, schema.TEMPORARY, module, "aten::mm",
                             source_of(module, 50))
                ev.free(t, act_size // 2, schema.TEMPORARY, module, "aten::mm",
                        source_of(module, 50))
            saved.append((module, size, ev.alloc(size, schema.ACTIVATION, module, "aten::addmm",
                                                 source_of(module, 40 + index % 3))))
            if all_categories:  # autocast's low-precision weight copy, freed after forward
                casts.append(ev.alloc(param_size // 2, schema.AUTOCAST_WEIGHT, module,
                                      "aten::_to_copy", source_of(module, 39)))

        for cast in casts:
            ev.free(cast, param_size // 2, schema.AUTOCAST_WEIGHT, "", "", ("", 0, ""))
        ev.phase = schema.BACKWARD
        for module, size, storage in reversed(saved):
            for _ in range(temporaries):
                t = ev.alloc(act_size // 2, schema.TEMPORARY, module, "aten::mm",
                             source_of(module, 60))
                ev.free(t, act_size // 2, schema.TEMPORARY, module, "aten::mm",
                        source_of(module, 60))
            grads[module] = ev.alloc(param_size, schema.GRADIENT, module, "aten::mm",
                                     source_of(module, 61))
            ev.free(storage, size, schema.ACTIVATION, module, "aten::addmm",
                    source_of(module, 40))

        ev.phase = schema.OPTIMIZER
        for module in modules:
            if module not in state:
                state[module] = [ev.alloc(param_size, schema.OPTIMIZER_STATE, "",
                                          "aten::zeros_like", ("optim.py", 90, "step"))
                                 for _ in range(2)]
            t = ev.alloc(param_size, schema.TEMPORARY, "", "aten::add", ("optim.py", 95, "step"))
            ev.free(t, param_size, schema.TEMPORARY, "", "aten::add", ("optim.py", 95, "step"))

        ev.phase = schema.OTHER_PHASE
        ev.free(batch, 256 * 1024, schema.INPUT, "", "", ("train.py", 40, "main"))
        step_info.append(asdict(schema.StepInfo(
            index=step, start_ns=start_ns, end_ns=ev.time_ns,
            duration_s=(ev.time_ns - start_ns) / 1e9)))
    return ev.columns, step_info


def make_trace(path: str | Path, events: int = 10_000, *, steps: int = 3, layers: int = 8,
               activation_scale: float = 1.0, hostile: bool = True,
               all_categories: bool = False, script: str = "train.py") -> Path:
    """Write a synthetic trace of about ``events`` events to ``path``.

    ``all_categories`` adds an 'other', a buffer and autocast weight copies, so that all
    nine categories are drawn (the heaviest timeline a report can have)."""
    columns, step_info = make_events(events, steps=steps, layers=layers,
                                     activation_scale=activation_scale, hostile=hostile,
                                     all_categories=all_categories)
    modules = _layer_modules(layers, hostile)
    meta = schema.TraceMeta(
        script=script, device="cuda:0", device_name="synthetic GPU",
        steps_requested=steps, steps_completed=steps, step_detection="optimizer",
        parameter_bytes=len(modules) * MIB, parameter_count=len(modules) * MIB // 4,
        steps=step_info,
        modules=[asdict(schema.ModuleInfo(path=m, type="Linear", parameter_bytes=MIB,
                                          parameter_count=MIB // 4, buffer_bytes=0,
                                          total_parameter_bytes=MIB)) for m in modules],
        optimizers=[{"class": "Adam", "hyperparameters": {"lr": 1e-3}}],
    )
    return write_trace(path, events_table(columns), meta)
