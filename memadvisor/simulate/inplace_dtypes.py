"""16-bit plans the script's own code cannot run: an op that refuses a source of another
dtype than its destination, fed one side in 16-bit and the other in fp32.

``index_add_``, ``scatter_add_``, ``index_copy_``, ``index_put_``, ``masked_scatter_`` and
their relatives (``apply.batch_watch.MIXED_DTYPE_REFUSED``, measured on torch 2.13) raise
when self and source differ in dtype, and autocast casts neither side.  A message-passing
layer (``torch.zeros_like(h).index_add_(0, dst, msg)``, ``msg`` scaled by a degree the
script counted in a ``torch.zeros(n)``) runs in fp32 and crashes under ``amp-bf16``.

In-place ops make no storage, so the trace has no row for them: the call sites come from
the script's source (the files the trace's rows name), their two sides from the trace's
rows (a call on the line itself: its row; a name: the rows of its last assignment in the
function), and each side's dtype under the plan from the data flow (``input_ids``), as
type promotion and autocast decide it (``regimes``): a low-precision op (matmul,
convolution) is 16-bit, an fp32-list op fp32, a factory without ``dtype=`` (torch's default
dtype) fp32, parameters, buffers and the model's inputs fp32 under ``amp-*`` and 16-bit
under ``bf16``, any other op 16-bit where every floating tensor with dimensions it reads
is.  Whatever the script converts itself (``.to(...)``, ``dtype=...``) or the trace cannot
tell is unknown, and an unknown side refuses nothing.  This is a dtype question, not the
memory model of ``precision.py``.
"""
from __future__ import annotations

import ast
import linecache
import os
from dataclasses import dataclass

import numpy as np
import pandas as pd

from ..trace import schema
from .hardware import device_rules
from .replay import CATEGORY_CODE, PHASE_CODE, Timeline

#: method -> position of the source among the arguments after self (torch 2.13)
REFUSING = {"index_add_": 2, "index_add": 2, "scatter_add_": 2, "scatter_add": 2,
            "scatter_": 2, "scatter": 2, "scatter_reduce_": 2, "scatter_reduce": 2,
            "index_copy_": 2, "index_copy": 2, "index_reduce_": 2, "index_reduce": 2,
            "masked_scatter_": 1, "masked_scatter": 1, "index_put_": 1, "index_put": 1,
            "put_": 1, "lerp_": 0, "lerp": 0}
_SOURCE_KEYWORDS = ("source", "src", "values", "value")
#: the script sets the dtype itself: unknown to the trace
_CONVERSIONS = {"to", "type", "type_as", "float", "half", "bfloat16", "double"}
_LOW, _FP32, _UNKNOWN = 1, 0, -1
#: in every refusal of ``refusal`` (``advise`` lists these reasons)
REFUSAL_MARK = "which torch refuses"
_FORWARD = PHASE_CODE[schema.FORWARD]


@dataclass(frozen=True)
class Site:
    """One call of a refusing op in the script: its two sides as trace rows, per run."""
    where: str  #: "file:line `code`"
    op: str
    pairs: tuple[tuple[int, int], ...]  #: (destination row, source row) per call


@dataclass(frozen=True)
class Sites:
    sites: list[Site]
    #: per row: made by a call to which the script gives its dtype (``dtype=``, ``.to``)
    script_typed: np.ndarray


def find_sites(timeline: Timeline, files: np.ndarray, lines: np.ndarray) -> Sites:
    """The refusing calls of the script files the forward rows name (``files``/``lines``:
    each row's source location, '' / 0 where unknown) whose two sides have rows."""
    forward = np.flatnonzero((timeline.phase == _FORWARD) & (timeline.alloc_key >= 0))
    forward = forward[np.argsort(timeline.alloc_key[forward], kind="stable")]
    sites = []
    typed = np.zeros(len(timeline), bool)
    for path in sorted({str(f) for f in files[forward] if f}):
        tree = _parse(path)
        if tree is None:
            continue
        here = forward[files[forward] == path]
        typed_calls = _typed_calls(tree)
        for row in here.tolist():
            name = timeline.ops[int(timeline.op[row])].removeprefix("aten::")
            typed[row] = name in typed_calls.get(int(lines[row]), ())
        for function, call, op, destination, source in _calls(tree):
            row_of = _RowFinder(here, lines[here], timeline, function, call.lineno)
            pairs = tuple(zip(row_of(destination), row_of(source)))
            if pairs:
                code = linecache.getline(path, call.lineno).strip()
                sites.append(Site(f"{path}:{call.lineno} `{code}`", op, pairs))
    return Sites(sites, typed)


def row_sources(trace, timeline: Timeline) -> tuple[np.ndarray, np.ndarray]:
    """(file, line) of the script's line that made each row of ``timeline`` (the analysed
    step of ``trace``; '' and 0 where unknown or made before the step)."""
    from ..trace.analysis import analysed_step, step_slice
    events = trace.events
    files = np.full(len(timeline), "", dtype=object)
    lines = np.zeros(len(timeline), np.int64)
    if "source_file" not in events or not len(timeline):
        return files, lines
    start = step_slice(events, analysed_step(trace)).start
    event = np.where(timeline.alloc_key >= 0, start + timeline.alloc_key, -1).astype(np.int64)
    known = event >= 0
    files[known] = events["source_file"].to_numpy()[event[known]]
    lines[known] = events["source_line"].fillna(0).to_numpy().astype(np.int64)[event[known]]
    files[pd.isna(files)] = ""
    cwd = getattr(trace.meta, "cwd", "") or ""
    for name in set(files[known].tolist()) if cwd else ():
        if name and not os.path.isabs(name):  # recorded relative to the run's folder
            files[files == name] = os.path.join(cwd, name)
    return files, lines


def where(files: np.ndarray, lines: np.ndarray, row: int) -> str:
    """``file:line `code``` of a row, or '' where the trace does not say."""
    if not files[row] or not lines[row]:
        return ""
    code = linecache.getline(str(files[row]), int(lines[row])).strip()
    return f"{files[row]}:{lines[row]}" + (f" `{code}`" if code else "")


def find_sites_in(trace, timeline: Timeline) -> Sites | None:
    """``find_sites`` for the analysed step of ``trace`` (None: no such call)."""
    files, lines = row_sources(trace, timeline)
    if not files.any():
        return None
    found = find_sites(timeline, files, lines)
    return found if found.sites else None


def refusal(found: Sites | None, timeline: Timeline, precision: str, device_type: str
            ) -> str | None:
    """Why ``precision`` cannot run the script (its first site whose sides differ), or None."""
    if precision not in ("amp-bf16", "amp-fp16", "bf16") or found is None:
        return None
    regime = regimes(timeline, precision, device_type, found.script_typed)
    low = "float16" if precision == "amp-fp16" else "bfloat16"
    for site in found.sites:
        for destination, source in site.pairs:
            if site.op.startswith("index_put") and _elements(timeline.shape[source]) == 1:
                continue  # one value fills the places, cast (torch 2.13)
            if {regime[destination], regime[source]} == {_LOW, _FP32}:
                written = [low if regime[r] == _LOW else "float32" for r in (source, destination)]
                return (f"precision={precision}: {site.where}: {site.op} would write a "
                        f"{written[0]} source into a {written[1]} tensor, which torch refuses "
                        f"(autocast casts neither side of {site.op}); make the two agree in the "
                        "script (dtype=, .to(...)) or keep fp32")
    return None


def _elements(shape: str) -> int:
    return int(np.prod([int(d) for d in str(shape).split(",") if d])) if shape else 1


def regimes(timeline: Timeline, precision: str, device_type: str,
            script_typed: np.ndarray) -> np.ndarray:
    """Per row: 16-bit (1), fp32 (0) or unknown (-1) under ``precision``, for the rows the
    forward makes (the others: as the plan stores them); ``script_typed``: rows whose dtype
    the script sets (unknown where they read no floating tensor)."""
    rules = device_rules(device_type)
    lower, fp32_ops = rules["autocast_lower"], rules["autocast_fp32"]
    floating = timeline.dtype_in(("float32", "float16", "bfloat16"))
    scalar = np.asarray(timeline.shape == "", bool)
    model_state = timeline.category_mask(schema.PARAMETER, schema.BUFFER, schema.INPUT)
    out = np.where(floating, _FP32, _UNKNOWN).astype(np.int8)
    if precision == "bf16":  # parameters, buffers and the model's inputs are cast
        out[model_state & floating] = _LOW
    reads = timeline.reads
    forward = np.flatnonzero((timeline.phase == _FORWARD) & (timeline.alloc_key >= 0))
    forward = forward[np.argsort(timeline.alloc_key[forward], kind="stable")]
    ops = timeline.ops
    for row in forward.tolist():
        op = ops[int(timeline.op[row])]
        if not floating[row]:
            out[row] = _UNKNOWN
        elif op in lower:
            out[row] = _LOW
        elif op in fp32_ops:
            out[row] = _FP32
        elif op == "aten::_to_copy" or reads is None:
            out[row] = _UNKNOWN
        else:
            read = reads.of(row)
            read = read[floating[read]]
            if len(read) and not scalar[read].all():
                read = read[~scalar[read]]
            seen = set(out[read].tolist())
            if not len(read):  # a factory: torch's default dtype, or the one it was given
                out[row] = _UNKNOWN if script_typed[row] else _FP32
            else:
                out[row] = (_UNKNOWN if _UNKNOWN in seen else _LOW if seen == {_LOW}
                            else _FP32)
    return out


class _RowFinder:
    """The rows an expression of the call's line stands for, one per run of the line."""

    def __init__(self, rows, lines, timeline, function, line):
        self.rows, self.lines, self.timeline = rows, lines, timeline
        self.function, self.line = function, line

    def __call__(self, node) -> list[int]:
        if isinstance(node, ast.Call):
            name = _called(node)
            if name is None or name in _CONVERSIONS or _sets_dtype(node):
                return []
            op = f"aten::{name}"
            return [r for r in self._runs(self.line, last=False)
                    if self.timeline.ops[int(self.timeline.op[r])] == op]
        if isinstance(node, ast.Name):
            assigned = _last_assignment(self.function, node.id, self.line)
            if assigned is None or _converts(assigned.value):
                return []
            return self._runs(assigned.lineno, last=True)
        return []

    def _runs(self, line: int, last: bool) -> list[int]:
        """The rows made on ``line``; ``last``: only the last of each unbroken run (the value
        an assignment keeps)."""
        at = self.lines == line
        if not last:
            return self.rows[at].tolist()
        ends = at & ~np.append(at[1:], False)
        return self.rows[ends].tolist()


def _parse(path: str):
    text = "".join(linecache.getlines(path))
    if not text:
        return None
    try:
        return ast.parse(text)
    except (SyntaxError, ValueError):
        return None


def _calls(tree):
    """(function node, call, op, destination expression, source expression) per refusing
    call: ``x.index_add_(0, i, s)`` and ``torch.index_add(x, 0, i, s)``."""
    for function in [tree, *(n for n in ast.walk(tree)
                             if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]:
        for node in _own_nodes(function):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            op = node.func.attr
            if op not in REFUSING:
                continue
            args = list(node.args)
            if isinstance(node.func.value, ast.Name) and node.func.value.id == "torch":
                if not args:
                    continue
                destination, args = args[0], args[1:]
            else:
                destination = node.func.value
            index = REFUSING[op]
            source = args[index] if len(args) > index else next(
                (k.value for k in node.keywords if k.arg in _SOURCE_KEYWORDS), None)
            if source is not None:
                yield function, node, op, destination, source


def _typed_calls(tree) -> dict[int, set[str]]:
    """line -> names of the calls there given a dtype (``dtype=``) or converting."""
    out: dict[int, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and (_sets_dtype(node) or _called(node) in _CONVERSIONS):
            out.setdefault(node.lineno, set()).add(str(_called(node)))
    return out


def _own_nodes(function):
    """The nodes of a function (or module) outside the functions defined inside it."""
    todo = list(ast.iter_child_nodes(function))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        yield node
        todo.extend(ast.iter_child_nodes(node))


def _last_assignment(function, name: str, line: int):
    best = None
    for node in _own_nodes(function):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.lineno < line \
                and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                if best is None or node.lineno > best.lineno:
                    best = node
    return best


def _called(node: ast.Call) -> str | None:
    func = node.func
    return func.attr if isinstance(func, ast.Attribute) else (
        func.id if isinstance(func, ast.Name) else None)


def _sets_dtype(node: ast.Call) -> bool:
    return any(k.arg == "dtype" for k in node.keywords)


def _converts(node) -> bool:
    """The expression converts or sets a dtype somewhere (the script decides it)."""
    return any(isinstance(n, ast.Call) and (_sets_dtype(n) or _called(n) in _CONVERSIONS)
               for n in ast.walk(node))
