"""Compilation advice: the activations ``torch.compile`` would stop saving, and the peak.

Eager autograd saves what each op's backward formula needs; ``torch.compile`` (inductor)
partitions the whole forward+backward graph with AOTAutograd's min-cut partitioner, which
recomputes cheap pointwise results in backward instead of saving them.  What it saves is
decided at compile time, so it is predicted by compiling without generating code:

* the recorded script runs again (a child process), with the model the optimizer trains
  (found as ``apply`` finds it, ``apply.find``) compiled by a backend that is inductor's
  own front half -- ``torch._inductor.compile_fx.compile_fx``: its decompositions, joint
  graph passes and partitioner with inductor's settings -- whose ``inner_compile`` records
  each forward graph's saved outputs and returns the graph to run as it is (no C++);
* by default on fake tensors (``memadvisor.fake``: no memory, no compute, any size), or on
  real CPU tensors (``method='real'``);
* the first forward runs eagerly, the second compiled; at each backward the tensors every
  autograd node holds are summed (distinct storages, the model's parameters, buffers and
  inputs left out), so eager and compiled are measured alike, eager code between graphs
  (graph breaks) included.  The run stops at the compiled forward's backward.

The peak it would give: the eager trace's analysed step with its activation bytes scaled
by compiled/eager saved bytes at every event, ``max(live - activation * (1 - ratio))``: the
forward builds, and backward frees, the compiled saved set in proportion to the eager one
(exact as backward starts, every saved tensor alive).  What inductor's kernels make in
temporaries instead of eager's is not predicted (docs/COMPILE_ADVICE.md: -2.1% to +0.2%).

``measure_compiled_run`` is the ground truth: the script with its model compiled by
inductor for real (CPU, C++), its saved tensors summed the same way and its step peaks from
the native CPU allocator hook (``profile.native``).
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError

#: a prediction or measurement that takes longer is stopped (a script that never backwards)
CHILD_TIMEOUT_S = 900.0
COMPILE_CALL = "__memadvisor_compile__"


@dataclass(kw_only=True, slots=True)
class GraphSaving:
    """One compiled forward graph: what the partitioner has it save for backward."""
    saved_bytes: int  #: distinct storages among the saved outputs that are not graph inputs
    saved_tensors: int  #: saved outputs that are not graph inputs
    saved_inputs: int  #: saved graph inputs (parameters, the batch, earlier graphs' outputs)
    layout_copy_bytes: int  #: channels-last copies of saved inputs inductor makes
    largest: list[str] = field(default_factory=list)  #: 'name shape dtype bytes', top 3


@dataclass(kw_only=True, slots=True)
class PeakPrediction:
    eager_peak_bytes: int  #: the analysed step's peak
    activation_at_peak_bytes: int  #: activation bytes alive at it
    predicted_peak_bytes: int
    eager_backward_start_bytes: int  #: live bytes as the step's backward starts
    predicted_backward_start_bytes: int


@dataclass(kw_only=True)
class CompileSaving:
    eager_saved_bytes: int  #: what eager autograd holds at the end of forward
    compiled_saved_bytes: int  #: what it would hold with the model compiled
    #: of each, the model's own outputs (the logits a loss needs): alive in either run
    eager_saved_output_bytes: int
    compiled_saved_output_bytes: int
    graphs: list[GraphSaving]
    graph_breaks: dict[str, int]  #: reason -> times dynamo broke the graph there
    peak: PeakPrediction  #: the eager trace's analysed step and what compiling makes it
    method: str  #: 'fake' or 'real': the tensors the prediction ran on
    seconds: float

    @property
    def saved_reduction_bytes(self) -> int:
        return self.eager_saved_bytes - self.compiled_saved_bytes

    @property
    def predicted_peak_bytes(self) -> int:
        return self.peak.predicted_peak_bytes

    @property
    def eager_peak_bytes(self) -> int:
        return self.peak.eager_peak_bytes


def compile_saving(trace_path: str | os.PathLike, *, method: str = "fake") -> CompileSaving:
    """The compile advice for the script ``trace_path`` recorded (run again, its recorded
    arguments, in its recorded folder); UserError (one line) when it cannot be run."""
    from ..trace.io import read_trace
    started = time.monotonic()
    if method not in ("fake", "real"):
        raise UserError(f"method must be 'fake' or 'real', not {method!r}")
    trace = read_trace(trace_path)
    if str(trace.meta.device or "cpu").startswith("cuda"):
        # on the simulated GPU dynamo stops at the fake CUDA device's patched functions
        # (tried on gpt_lm: 'Handler already registered' at torch.arange(device=...))
        raise UserError(f"{trace_path}: the compile advice predicts CPU runs only so far; "
                        f"this trace ran on {trace.meta.device}")
    found = run_script_compiled(trace.meta, trace_path, mode="predict", method=method)
    eager, compiled = found["eager_saved_bytes"], found["compiled_saved_bytes"]
    eager_outputs = found["eager_saved_output_bytes"]
    compiled_outputs = found["compiled_saved_output_bytes"]
    # the model's outputs are alive in the eager trace whether saved (activation) or not
    # (temporary): only the compiled run's other saved bytes replace eager's activations
    peak = predicted_peak(trace, eager, compiled - compiled_outputs + eager_outputs)
    return CompileSaving(
        eager_saved_bytes=eager, compiled_saved_bytes=compiled,
        eager_saved_output_bytes=eager_outputs, compiled_saved_output_bytes=compiled_outputs,
        graphs=[GraphSaving(**g) for g in found["graphs"]],
        graph_breaks=found["graph_breaks"], peak=peak, method=method,
        seconds=time.monotonic() - started)


def predicted_peak(trace, eager_saved_bytes: int, compiled_saved_bytes: int) -> PeakPrediction:
    """The analysed step with each event's activation bytes scaled by
    ``compiled_saved_bytes / eager_saved_bytes`` (the compiled figure without the model
    outputs eager does not save): its peak, and its live bytes as backward starts (every
    saved tensor alive: there the substitution is exact)."""
    import numpy as np
    from ..trace.analysis import analysed_step, category_series, live_bytes, peak_in, \
        step_slice
    events = trace.events
    window = step_slice(events, analysed_step(trace))
    live = live_bytes(events)
    activation = category_series(events, "activation")
    position, peak = peak_in(live, window)
    if position < 0:
        raise UserError(f"{trace.path}: the trace has no events in its analysed step")
    ratio = compiled_saved_bytes / eager_saved_bytes if eager_saved_bytes else 1.0
    scaled = live[window] - activation[window] * (1.0 - ratio)
    backward = np.flatnonzero((events["phase"].to_numpy()[window] == "backward"))
    before = window.start + int(backward[0]) - 1 if len(backward) else position
    return PeakPrediction(
        eager_peak_bytes=peak, activation_at_peak_bytes=int(activation[position]),
        predicted_peak_bytes=int(np.rint(scaled.max())),
        eager_backward_start_bytes=int(live[before]),
        predicted_backward_start_bytes=int(np.rint(live[before] - activation[before]
                                                   * (1.0 - ratio))))


def measure_compiled_run(trace_path: str | os.PathLike, *, backend: str = "inductor",
                         steps: int = 3) -> dict:
    """Ground truth: the recorded script run for real on this CPU for ``steps`` optimizer
    steps with its model compiled by ``backend`` ('inductor'; 'eager': not compiled at
    all), each backward's saved bytes (``saved_bytes``, a list) and each step's peak CPU
    bytes above the script's start (``step_peak_bytes``)."""
    from ..trace.io import read_meta
    if backend not in ("inductor", "eager"):
        raise UserError(f"backend must be 'inductor' or 'eager', not {backend!r}")
    meta = read_meta(trace_path)
    return run_script_compiled(meta, trace_path, mode=backend, method="real", steps=steps)


# --- running the script again ------------------------------------------------------------
def compile_inserted(source: str, filename: str) -> str:
    """``source`` with ``__memadvisor_compile__(<model>)`` after the statement that makes
    each optimizer, the model found as ``apply`` finds it."""
    import libcst as cst
    from ..apply.find import ScriptFinder, ScriptNotUnderstood
    try:
        module = cst.parse_module(source)
        found = ScriptFinder(module, filename).find()
    except cst.ParserSyntaxError as exc:
        raise UserError(f"cannot parse {filename}: line {exc.editor_line}") from None
    except ScriptNotUnderstood as exc:
        raise UserError(str(exc).splitlines()[0]) from None
    after = {}
    for pair in found.pairs:
        after.setdefault(pair.statement, []).append(pair.model)

    class Insert(cst.CSTTransformer):
        def _body(self, original, updated):
            body = []
            for old, new in zip(original.body, updated.body):
                body.append(new)
                body += [cst.parse_statement(f"{COMPILE_CALL}({model})\n")
                         for model in after.get(old, ())]
            return updated.with_changes(body=body)

        def leave_Module(self, original, updated):
            return self._body(original, updated)

        def leave_IndentedBlock(self, original, updated):
            return self._body(original, updated)

    return module.visit(Insert()).code


def run_script_compiled(meta, trace_path, *, mode: str, method: str, steps: int = 2) -> dict:
    """Run the recorded script in a child with the model compiled (``mode``: 'predict',
    'inductor' or 'eager'); the child's result, or UserError naming what went wrong."""
    from ..verify.script import applied_copy, in_user_terms, locate_script
    script, problem = locate_script(meta, trace_path)
    if script is None:
        raise UserError(f"{trace_path}: the compile advice runs the profiled script again, "
                        f"but {problem.removeprefix('the profiled script ')}")
    code = compile_inserted(script.source, str(script.path))
    with applied_copy(script, code) as copy, \
            tempfile.TemporaryDirectory(prefix="memadvisor-compile-") as folder:
        spec = {"script": str(copy), "argv0": str(script.path), "args": script.args,
                "mode": mode, "method": method, "steps": steps,
                "result": str(Path(folder) / "result.json")}
        spec_path = Path(folder) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        try:
            proc = subprocess.run([sys.executable, "-m", "memadvisor.advice.compile_saving",
                                   str(spec_path)], cwd=str(script.cwd), env=env, text=True,
                                  capture_output=True, errors="replace",
                                  timeout=CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise UserError(f"{script.path} compiled did not reach its backward in "
                            f"{CHILD_TIMEOUT_S:.0f} s") from None
        result_path = Path(spec["result"])
        if not result_path.exists():
            said = [line for line in proc.stderr.splitlines() if line.strip()]
            raise UserError(f"running {script.path} compiled ended without a result "
                            f"(exit status {proc.returncode})"
                            + (f": {said[-1].strip()}" if said else ""))
        result = json.loads(result_path.read_text())
        plain = lambda text: in_user_terms(text, copy, script, code)  # noqa: E731
        if result.get("error"):
            raise UserError(f"running {script.path} compiled ({mode}): "
                            f"{plain(result['error'])}")
        result["graph_breaks"] = {plain(k): v for k, v in result["graph_breaks"].items()}
        return result


# --- the child ---------------------------------------------------------------------------
class _Stop(BaseException):
    """Ends the script once what was asked is measured (not an Exception: a script's own
    ``except Exception`` must not swallow it)."""


def _storage_key(tensor) -> int:
    return tensor.untyped_storage()._cdata  # the StorageImpl: shared by views, fake or real


def saved_storages(roots, excluded: set[int]) -> dict[int, int]:
    """Storage key -> bytes of the distinct storages every autograd node reachable from
    ``roots`` holds for backward (C++ nodes' ``_saved_*``, Python ones' ``saved_tensors``
    and AOTAutograd's ``_tensors_no_vc_check``), leaving out the storages in ``excluded``."""
    import torch
    stack = [r.grad_fn for r in roots if isinstance(r, torch.Tensor) and r.grad_fn is not None]
    seen, held = set(), {}
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        tensors = []
        for name in dir(node):
            if name.startswith("_saved_"):
                try:
                    value = getattr(node, name)
                except RuntimeError:  # freed by an earlier backward (retain_graph=False)
                    continue
                tensors += value if isinstance(value, (list, tuple)) else [value]
        if hasattr(node, "saved_tensors"):
            tensors += list(node.saved_tensors)
            tensors += list(getattr(node, "_tensors_no_vc_check", None) or ())
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor) and _storage_key(tensor) not in excluded:
                held[_storage_key(tensor)] = tensor.untyped_storage().nbytes()
        stack += [following for following, _ in node.next_functions]
    return held


def saved_tensor_bytes(roots, excluded: set[int]) -> int:
    """Bytes of :func:`saved_storages`."""
    return sum(saved_storages(roots, excluded).values())


def _graph_saving(gm) -> dict:
    """What the partitioned forward graph ``gm`` saves: its outputs past the user-visible
    ones (AOTAutograd's ``tensors_saved_for_backwards_slice``), from their fake values."""
    import torch
    from torch._guards import TracingContext
    outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    saved = list(outputs[TracingContext.get().fw_metadata.tensors_saved_for_backwards_slice])
    kept, inputs, held = [], 0, {}
    for node in saved:
        value = getattr(node, "meta", {}).get("val")
        if not isinstance(value, torch.Tensor):
            continue
        if node.op == "placeholder":
            inputs += 1
            continue
        nbytes = value.untyped_storage().nbytes()
        held[_storage_key(value)] = nbytes
        kept.append((nbytes, f"{node.name} {tuple(value.shape)} {value.dtype} {nbytes:,} B"))
    kept.sort(key=lambda item: -item[0])
    return {"saved_bytes": sum(held.values()), "saved_tensors": len(kept),
            "saved_inputs": inputs, "layout_copy_bytes": _layout_copy_bytes(gm, saved),
            "largest": [text for _, text in kept[:3]]}


def _layout_copy_bytes(gm, saved) -> int:
    """Bytes of the channels-last copies inductor saves in place of saved graph inputs.
    With layout optimisation (``GraphLowering.decide_layout_opt``: on a CPU with oneDNN,
    any graph with a convolution) the lowering copies a convolution's input and weight
    that are graph inputs (the batch, parameters) to channels-last, and backward saves
    the copies: new storages where eager saves the parameter itself."""
    import torch
    from torch._inductor.graph import GraphLowering
    if not GraphLowering.decide_layout_opt(gm, is_inference=False):
        return 0
    convolution_args = {arg for node in gm.graph.nodes
                        if node.target is torch.ops.aten.convolution.default
                        for arg in node.args[:2]}
    formats = {4: torch.channels_last, 5: torch.channels_last_3d}
    total = 0
    for node in dict.fromkeys(saved):  # once each, in order
        value = getattr(node, "meta", {}).get("val")
        if getattr(node, "op", None) != "placeholder" or node not in convolution_args or \
                not isinstance(value, torch.Tensor) or value.dim() not in formats:
            continue
        if not value.is_contiguous(memory_format=formats[value.dim()]):
            total += value.numel() * value.element_size()
    return total


class _Child:
    def __init__(self, spec: dict):
        self.spec = spec
        self.graphs: list[dict] = []
        self.saved: list[int] = []
        self.excluded: set[int] = set()  # the models' parameters and buffers
        # this step's model inputs and outputs, kept alive so that no other storage takes
        # their keys
        self.inputs: list = []
        self.outputs: list = []
        self.saved_outputs: list[int] = []  # of each backward's saved bytes, model outputs'
        self.compiling = spec["mode"] != "predict"  # predict: the first forward eager
        self.hook = self.start_bytes = None
        self.step_peaks: list[int] = []
        self.backward_start_bytes: list[int] = []  # live CPU bytes as each backward starts

    def backend(self):
        if self.spec["mode"] == "inductor":
            return "inductor"
        import torch._functorch.config as functorch_config
        import torch._inductor.config as inductor_config
        from torch._functorch._aot_autograd.utils import make_boxed_func
        # a cache hit would load inductor's code from an earlier compile and never call
        # inner_compile: the graphs must be partitioned here
        inductor_config.fx_graph_cache = False
        functorch_config.enable_autograd_cache = False
        from torch._inductor.compile_fx import compile_fx

        def inner_compile(gm, example_inputs, **kwargs):
            if not kwargs.get("is_backward") and not kwargs.get("is_inference"):
                self.graphs.append(_graph_saving(gm))
            return make_boxed_func(gm.forward)  # the partitioned graph, run as it is
        return lambda gm, example_inputs: compile_fx(gm, example_inputs,
                                                     inner_compile=inner_compile)

    def compile_model(self, model) -> None:
        import torch
        from torch.utils._pytree import tree_leaves
        for tensor in [*model.parameters(), *model.buffers()]:
            self.excluded.add(_storage_key(tensor))
        eager = model._call_impl
        compiled = eager if self.spec["mode"] == "eager" else \
            torch.compile(eager, backend=self.backend())

        def call(*args, **kwargs):
            for leaf in tree_leaves((args, kwargs)):
                if isinstance(leaf, torch.Tensor):
                    self.inputs.append(leaf)
            result = (compiled if self.compiling else eager)(*args, **kwargs)
            self.outputs += [t for t in tree_leaves(result) if isinstance(t, torch.Tensor)]
            return result
        model._compiled_call_impl = call  # what nn.Module.compile() sets

    def before_backward(self, roots) -> None:
        import torch
        roots = [roots] if isinstance(roots, torch.Tensor) else list(roots or ())
        if self.hook is not None:
            self.backward_start_bytes.append(self.hook.live_bytes - self.start_bytes)
        inputs = {_storage_key(tensor) for tensor in self.inputs}
        held = saved_storages(roots, self.excluded | inputs)
        self.saved.append(sum(held.values()))
        outputs = {_storage_key(tensor) for tensor in self.outputs}
        self.saved_outputs.append(sum(held.get(key, 0) for key in outputs))
        self.inputs.clear()
        self.outputs.clear()
        if self.spec["mode"] == "predict":
            if self.compiling:
                raise _Stop()
            self.compiling = True

    def after_step(self, *_):
        if self.hook is not None:
            self.step_peaks.append(self.hook.peak_bytes - self.start_bytes)
            self.hook.reset_peak()
        if self.spec["mode"] != "predict" and len(self.saved) >= self.spec["steps"]:
            raise _Stop()  # predict stops at its compiled forward's backward

    def run(self) -> dict:
        import runpy
        import torch
        from torch.optim.optimizer import register_optimizer_step_post_hook
        if self.spec["method"] == "real" and self.spec["mode"] != "predict":
            from ..profile.native import AllocatorHook
            self.hook = AllocatorHook.load()
        from torch._guards import TracingContext
        originals = torch.autograd.backward, torch.autograd.grad

        def wrap(original, key):
            def run(*args, **kwargs):
                # AOTAutograd traces the joint graph with autograd.grad: not the script's
                if TracingContext.try_get() is None:
                    self.before_backward(args[0] if args else kwargs.get(key))
                return original(*args, **kwargs)
            return run
        torch.autograd.backward = wrap(originals[0], "tensors")
        torch.autograd.grad = wrap(originals[1], "outputs")
        register_optimizer_step_post_hook(self.after_step)
        sys.argv = [self.spec["argv0"], *self.spec["args"]]
        sys.path.insert(0, str(Path(self.spec["script"]).parent))
        if self.hook is not None:
            self.start_bytes = self.hook.live_bytes
            self.hook.reset_peak()
        context = _fake_context() if self.spec["method"] == "fake" else \
            contextlib.nullcontext()
        try:
            with context:
                runpy.run_path(self.spec["script"], run_name="__main__",
                               init_globals={COMPILE_CALL: self.compile_model})
        except _Stop:
            pass
        except SystemExit as exc:
            if exc.code not in (0, None):
                return {"error": f"the script exited with status {exc.code}"}
        except Exception as exc:  # noqa: BLE001 -- one line, never a traceback
            return {"error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"}
        finally:
            torch.autograd.backward, torch.autograd.grad = originals
        return self.result()

    def result(self) -> dict:
        from torch._dynamo.utils import counters
        expected = 2 if self.spec["mode"] == "predict" else 1
        if len(self.saved) < expected:
            return {"error": f"the script ran {len(self.saved)} backward(s) with the model "
                             f"compiled, {expected} needed"}
        breaks: dict[str, int] = {}
        for reason, count in counters["graph_break"].items():
            # dynamo's reason, without the explanation and hints it appends
            text = " ".join(str(reason).split()).split(" Explanation:")[0][:200]
            breaks[text] = breaks.get(text, 0) + int(count)
        # what the partitioned graphs held, and the copies inductor's lowering adds
        compiled = self.saved[-1] + sum(g["layout_copy_bytes"] for g in self.graphs)
        return {"eager_saved_bytes": self.saved[0], "compiled_saved_bytes": compiled,
                "eager_saved_output_bytes": self.saved_outputs[0],
                "compiled_saved_output_bytes": self.saved_outputs[-1],
                "saved_bytes": self.saved, "graphs": self.graphs, "graph_breaks": breaks,
                "step_peak_bytes": self.step_peaks,
                "backward_start_bytes": self.backward_start_bytes}


def _fake_context():
    from ..fake.runtime import fake_execution
    return fake_execution(gpu=None)


def _child_main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    result = _Child(spec).run()
    Path(spec["result"]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1]))
