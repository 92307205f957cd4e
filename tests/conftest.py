"""Shared fixtures: paths, and each bundled example profiled once per test session.

Profiling an example costs a second or more, so ``example_runs`` profiles each example at
most once and hands the same result to every test that asks.  Every run also records
*independent* facts -- figures the tests compute themselves with plain torch APIs, never
through memadvisor -- so the trace can be checked against them:

- a global optimizer step post-hook (registered before the session's own, so it also
  runs on the step where the session stops) sums the parameter, gradient and
  optimizer-state storages of the optimizer at every step;
- a global module forward pre-hook remembers the root model, for its buffers;
- ``torch.profiler`` with ``profile_memory=True`` runs around the same run: replaying its
  ``[memory]`` events gives its own peak of live CPU bytes.
"""
from __future__ import annotations

import os
import importlib.util
import sys
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

# Test folders are packages (so two folders may both hold a test_cli.py); their helper
# modules (apply_runs, report_fakes, loops, ...) are imported by bare name, so put each
# folder on sys.path as pytest's rootdir mode would without packages.
for _folder in sorted(p for p in Path(__file__).parent.iterdir()
                      if p.is_dir() and (p / "__init__.py").exists()):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))
EXAMPLES_DIR = REPO_ROOT / "examples"
SCRIPTS_DIR = REPO_ROOT / "tests" / "fixtures" / "scripts"
EXAMPLE_NAMES = ("gpt_lm", "cnn_classifier", "mlp_regressor")


def load_example(name: str):
    """Import ``examples/<name>.py`` as a fresh module (examples are not a package)."""
    path = EXAMPLES_DIR / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"memadvisor_example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def storage_bytes(tensors) -> tuple[int, int]:
    """(bytes, count) of the distinct storages behind ``tensors`` (tied weights once)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen[storage.data_ptr() or id(storage)] = storage.nbytes()
    return sum(seen.values()), len(seen)


@dataclass
class StepFacts:
    """What the optimizer held at the end of one step, measured with torch APIs only."""

    parameter_bytes: int
    parameter_count: int  #: elements, over unique parameters
    parameter_tensors: int
    gradient_bytes: int
    optimizer_state_bytes: int
    buffer_bytes: int  #: of the root model seen by the module hook


@dataclass
class ExampleRun:
    name: str
    module: object  #: the imported example module
    trace: object  #: memadvisor.trace.Trace read back from ``trace_path``
    trace_path: Path
    facts: list[StepFacts] = field(default_factory=list)
    optimizer_class: str = ""
    #: peak of torch.profiler's replayed [memory] events (bytes above the start)
    kineto_peak_bytes: int = 0
    kineto_memory_events: int = 0
    wall_s: float = 0.0


class IndependentFacts:
    """Global torch hooks that measure model state without asking memadvisor."""

    def __init__(self):
        self.steps: list[StepFacts] = []
        self.optimizer_class = ""
        self._root: weakref.ref | None = None
        self._handles = []

    def __enter__(self):
        import torch
        from torch.nn.modules.module import register_module_forward_pre_hook
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self._handles = [register_optimizer_step_post_hook(self._after_step),
                         register_module_forward_pre_hook(self._before_forward)]
        self._torch = torch
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _before_forward(self, module, args):
        if self._root is None or self._root() is None:
            self._root = weakref.ref(module)  # the first module called: the model

    def _after_step(self, optimizer, args, kwargs):
        torch = self._torch
        params = [p for group in optimizer.param_groups for p in group["params"]]
        param_bytes, param_tensors = storage_bytes(params)
        unique = {p.untyped_storage().data_ptr(): p for p in params}.values()
        grads = [p.grad for p in params if p.grad is not None]
        state = [v for s in optimizer.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor)]
        root = self._root() if self._root is not None else None
        buffers = list(root.buffers()) if root is not None else []
        self.optimizer_class = type(optimizer).__name__
        self.steps.append(StepFacts(
            parameter_bytes=param_bytes,
            parameter_count=sum(p.numel() for p in unique),
            parameter_tensors=param_tensors,
            gradient_bytes=storage_bytes(grads)[0],
            optimizer_state_bytes=storage_bytes(state)[0],
            buffer_bytes=storage_bytes(buffers)[0],
        ))


def kineto_memory_peak(prof) -> tuple[int, int]:
    """(peak bytes, event count) of torch.profiler's CPU allocation events, replayed."""
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    if not events:
        return 0, 0
    live = np.cumsum(np.array([e.nbytes() for e in events], dtype=np.int64))
    return int(live.max()), len(events)


class ExampleRuns:
    """Profiles an example the first time it is asked for; later calls reuse the run."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._runs: dict[str, ExampleRun] = {}

    def get(self, name: str) -> ExampleRun:
        # one run per engine ($MEMADVISOR_ENGINE, set by tests/profile/conftest.py)
        key = f"{name}-{os.environ.get('MEMADVISOR_ENGINE', 'auto')}"
        if key not in self._runs:
            self._runs[key] = self._profile(name, key)
        return self._runs[key]

    def _profile(self, name: str, key: str) -> ExampleRun:
        from torch.profiler import ProfilerActivity, profile

        from memadvisor.profile import ProfileSession, StopProfiling
        from memadvisor.trace import read_trace

        module = load_example(name)
        path = self.folder / f"{key}.trace"
        started = time.perf_counter()
        # the facts' hooks are registered first so that they run before the session's
        # post-hook, which raises StopProfiling at the third step
        with IndependentFacts() as facts, \
                profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            session = ProfileSession(steps=3)
            try:
                with session:
                    module.main(["--steps", "10", "--seed", "0"])
            except StopProfiling:
                pass
        wall_s = time.perf_counter() - started
        session.write(path, script=str(EXAMPLES_DIR / f"{name}.py"), args=[])
        peak, count = kineto_memory_peak(prof)
        return ExampleRun(name=name, module=module, trace=read_trace(path), trace_path=path,
                          facts=list(facts.steps), optimizer_class=facts.optimizer_class,
                          kineto_peak_bytes=peak, kineto_memory_events=count, wall_s=wall_s)


@pytest.fixture(scope="session")
def example_runs(tmp_path_factory) -> ExampleRuns:
    return ExampleRuns(tmp_path_factory.mktemp("examples"))


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def example_loader():
    """``load_example`` for tests that run an example their own way."""
    return load_example
