"""Find what the rewrite needs in a training script: each model and its optimizer, the
backward calls, the steps, and (to split the batch) the forward..backward region and the
batch.  Pure syntax (libcst); nothing is imported or run.

What is looked for, and the comment that marks it when the search fails:

=========  ==================================================  ===========================
what       found as                                            mark with
=========  ==================================================  ===========================
optimizer  every stepped optimizer (find_calls.py)             ``# memadvisor: optimizer``
model      what each optimizer's parameters come from          ``# memadvisor: model``
backward   ``<loss>.backward()``, ``<scaler>.scale(<loss>)``     (one per step to split)
           ``.backward()``
step       ``<optimizer>.step([closure])``,                    (same name as the optimizer)
           ``<scaler>.step(<optimizer>)``
forward    first statement calling a model, in the block       ``# memadvisor: forward``
           that holds the backward
batch      variables the forward..backward statements read      ``# memadvisor: batch``
           as data, bound in the loop (or function, or the
           scopes around a closure) before them
=========  ==================================================  ===========================

The batch can only be split (accum, data parallel) around one forward..backward; with
several backward calls (a GAN) or no region found, ``Found.split_refusal`` says why, and
only plans that do not split the batch are rewritten.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

from .find_calls import TrainingCalls
from .find_region import RegionSearch
from .syntax import MARKER, NotFound, collect, dotted  # noqa: F401  (dotted: used by rewrite)

#: (module, its positions) by id: ``advise`` finds the training loop in one script (one
#: immutable tree, ``rewrite._parsed``) once per plan it checks, and resolving positions
#: was most of each search
_POSITIONS: dict[int, tuple] = {}


def _positions_of(module: cst.Module):
    hit = _POSITIONS.get(id(module))
    if hit is not None and hit[0] is module:
        return hit[1]
    positions = MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)
    if len(_POSITIONS) >= 8:
        _POSITIONS.pop(next(iter(_POSITIONS)))
    _POSITIONS[id(module)] = (module, positions)
    return positions


@dataclass
class Pair:
    """One model and the optimizer that trains it; ``prepare`` goes after ``statement``
    (the optimizer's), or after ``moved`` where the model is moved to its device later."""
    statement: cst.CSTNode
    optimizer: str  #: the optimizer as the script names it, e.g. 'optimizer', 'self.opt'
    model: str  #: e.g. 'model', 'self.model'
    opaque: bool = False  #: made by a call memadvisor cannot see into (checked at run time)
    methods: list[str] = field(default_factory=list)  #: model.<method>(...) the script calls
    #: ``model.to(device)`` / ``.cuda()`` statements right after the optimizer's (see
    #: ScriptFinder.device_move): prepare follows the last, so it shards on that device
    moved: cst.CSTNode | None = None

    @property
    def insert_after(self) -> cst.CSTNode:
        return self.moved if self.moved is not None else self.statement


@dataclass
class Backward:
    expr: cst.Expr  #: ``<loss>.backward()`` or ``<scaler>.scale(<loss>).backward()``
    loss: cst.BaseExpression
    scaler: cst.BaseExpression | None = None


@dataclass
class Step:
    expr: cst.Expr  #: ``<optimizer>.step(...)`` or ``<scaler>.step(<optimizer>, ...)``
    optimizer: cst.BaseExpression
    args: list  #: what the step is given besides the optimizer (a closure)
    scaler: cst.BaseExpression | None = None


@dataclass
class Found:
    pairs: list[Pair]
    backwards: list[Backward]
    steps: list[Step]
    unscales: list[Step]  #: ``<scaler>.unscale_(<optimizer>)`` statements
    clips: list[cst.Call]  #: ``torch.nn.utils.clip_grad_norm_/value_`` calls
    #: the forward..backward region the micro-batch loop wraps; None when the batch cannot
    #: be split (several backward calls per step): ``split_refusal`` says why
    block: cst.CSTNode | None = None
    region: list[cst.CSTNode] = field(default_factory=list)
    hoisted: list[cst.CSTNode] = field(default_factory=list)  #: ``zero_grad`` in the region
    #: statements of the region that fetch the next batch (nanoGPT's prefetch): they run
    #: once per step after the micro-batch loop, with their own names
    after: list[cst.CSTNode] = field(default_factory=list)
    batch: list[str] = field(default_factory=list)  #: names the region takes the batch from
    #: batch names bound outside the region's loop or function: the loop hands out parts
    #: under new names, or the next pass would split the previous pass's last part
    renames: dict[str, str] = field(default_factory=dict)
    split_refusal: str | None = None
    #: why the batch cannot be accumulated in micro-batches though it can be sliced per rank
    accum_refusal: str | None = None
    closure_steps: list[str] = field(default_factory=list)  #: 'line N: `opt.step(closure)`'
    shadow_copies: list[str] = field(default_factory=list)  #: see TrainingCalls.shadow_copies
    lines: dict[str, int] = field(default_factory=dict)  #: what -> line, for the report

    @property
    def model(self) -> str:
        return ", ".join(p.model for p in self.pairs)

    @property
    def optimizer(self) -> str:
        return ", ".join(p.optimizer for p in self.pairs)


class _Index(cst.CSTVisitor):
    """Parent and source order of every node, in one walk (libcst's metadata providers
    copy the tree and cost ~10x more; line numbers are resolved only for messages)."""

    def __init__(self):
        self.parents: dict = {}
        self.order: dict = {}
        self._stack: list = []

    def on_visit(self, node):
        if self._stack:
            self.parents[node] = self._stack[-1]
        self.order[node] = len(self.order)
        self._stack.append(node)
        return True

    def on_leave(self, original_node):
        self._stack.pop()


class ScriptFinder(TrainingCalls, RegionSearch):
    def __init__(self, module: cst.Module, filename: str = "script.py"):
        self.module = module
        index = _Index()
        module.visit(index)
        self.parents, self.order = index.parents, index.order
        self._positions = None
        self.filename = filename
        self.statements = [n for n in self.order
                           if isinstance(n, (cst.SimpleStatementLine, cst.BaseCompoundStatement))]

    # --- helpers ----------------------------------------------------------------------
    def line(self, node) -> int:
        if self._positions is None:
            self._positions = _positions_of(self.module)
        return self._positions[node].start.line

    def nodes(self, kinds) -> list:
        """Every node of the module of the given kinds, in source order."""
        return [n for n in self.order if isinstance(n, kinds)]

    def before(self, node, other) -> bool:
        """``node`` starts before ``other`` in the source."""
        return self.order[node] < self.order[other]

    def marker(self, statement) -> str | None:
        comment = getattr(getattr(statement, "trailing_whitespace", None), "comment", None)
        if comment is None and isinstance(statement, cst.BaseCompoundStatement):
            body = getattr(statement, "body", None)
            header = getattr(body, "header", None)
            comment = getattr(header, "comment", None)
        match = MARKER.search(comment.value) if comment is not None else None
        return match.group(1) if match else None

    def statement_of(self, node) -> cst.CSTNode:
        while not isinstance(node, (cst.SimpleStatementLine, cst.BaseCompoundStatement)):
            node = self.parents[node]
        return node

    def enclosing(self, node, kinds):
        while node is not self.module:
            node = self.parents[node]
            if isinstance(node, kinds):
                return node
        return self.module

    def assignments(self):
        """(statement, target expression, value) of every simple assignment."""
        for statement in self.statements:
            if not isinstance(statement, cst.SimpleStatementLine):
                continue
            for small in statement.body:
                if isinstance(small, cst.Assign) and len(small.targets) == 1:
                    yield statement, small.targets[0].target, small.value
                elif isinstance(small, cst.AnnAssign) and small.value is not None:
                    yield statement, small.target, small.value

    def expression_calls(self, attr: str) -> list[cst.Expr]:
        """Expression statements ``<something>.<attr>(...)``."""
        found = []
        for statement in self.statements:
            if not isinstance(statement, cst.SimpleStatementLine):
                continue
            for small in statement.body:
                if (isinstance(small, cst.Expr) and isinstance(small.value, cst.Call)
                        and isinstance(small.value.func, cst.Attribute)
                        and small.value.func.attr.value == attr):
                    found.append(small)
        return found

    # --- everything -------------------------------------------------------------------
    def find(self) -> Found:
        problems: dict[str, str] = {}

        def attempt(what, fn, *args):
            try:
                return fn(*args)
            except NotFound as exc:
                problems.setdefault(exc.what, str(exc))
                return None

        chosen = attempt("optimizer", self.optimizers) or []
        if any(not opaque for *_, opaque in chosen):
            # something else stepped (a warmup wrapper, an environment) whose model cannot
            # be told is not an optimizer when real ones were found
            chosen = [c for c in chosen if not c[3] or self._has_model(c[0], c[2])]
        pairs, steps = [], []
        for statement, optimizer, value, opaque in chosen:
            model = attempt("model", self.model, statement, value, len(chosen) == 1)
            found_steps = attempt("step", self.steps, optimizer)
            if model and found_steps:
                attempt("optimizer", self.check_prepare_runs, statement, optimizer, found_steps)
                pairs.append(Pair(statement, optimizer, model, opaque,
                                  self.model_methods(model, statement),
                                  self.device_move(statement, model, optimizer)))
                steps += found_steps
        backwards = attempt("backward", self.backwards)
        if "optimizer" in problems and not self.expression_calls("step"):
            problems.setdefault("step", "no `<optimizer>.step()` call found")
        if problems:
            raise ScriptNotUnderstood(self.filename, problems)
        found = Found(pairs=pairs, backwards=backwards, steps=steps, clips=self.clips(),
                      unscales=self.unscales([p.optimizer for p in pairs]))
        found.shadow_copies = self.shadow_copies([p.model for p in pairs])
        found.closure_steps = [f"line {self.line(s.expr)}: `{self._code(s.expr)}`"
                               for s in steps if s.args]
        found.lines = {"model/optimizer": self.line(pairs[0].statement),
                       "backward": self.line(backwards[0].expr), "step": self.line(steps[0].expr)}
        if len(backwards) > 1:
            lines = ", ".join(str(self.line(b.expr)) for b in backwards)
            several = f"{len(backwards)} `.backward()` calls (lines {lines})"
            found.accum_refusal = (f"{several} per iteration, each optimizer stepped between "
                                   "them; memadvisor accumulates micro-batches around one "
                                   "forward..backward per step")
            try:
                self._find_iteration(found)
            except NotFound as exc:
                found.split_refusal = f"{several}: {exc}"
            return found
        try:
            self._find_region(found)
        except NotFound as exc:
            found.split_refusal = str(exc)
            found.block, found.region, found.hoisted, found.after = None, [], [], []
        return found

    def device_move(self, statement, model: str, optimizer: str):
        """The last statement moving ``model`` to a device (``model.to(device)``,
        ``model.cuda()``, ``model = model.to(...)``) among the simple statements right after
        the optimizer's, in its block, with nothing between that names the optimizer or
        uses the model otherwise; None if there is none.

        Moving a model after building its optimizer is legal in PyTorch (``.to`` changes the
        parameters in place), but ``prepare`` right after the optimizer would shard or wrap
        it on the CPU (FSDP's mesh, DDP's buckets on the CPU) and the later move would leave
        them there: a real run on GPUs fails in its first all-gather."""
        parent = self.parents.get(statement)
        body = getattr(parent, "body", None)
        if not isinstance(body, (list, tuple)):
            return None
        index = next((i for i, s in enumerate(body) if s is statement), None)
        if index is None:
            return None
        moved = None
        for sibling in body[index + 1:]:
            if not isinstance(sibling, cst.SimpleStatementLine):
                break
            names = {dotted(n) for n in collect(sibling, (cst.Name, cst.Attribute))}
            if optimizer in names:
                break
            if _moves(sibling, model):
                moved = sibling
            elif model in names:
                break
        return moved

    def _has_model(self, statement, value) -> bool:
        try:
            self.model(statement, value, False)
        except NotFound:
            return False
        return True

    def crowded_line(self, found: "Found") -> str | None:
        """The first line of the micro-batch loop's region holding several statements
        (``opt.zero_grad(); loss.backward(); opt.step()``) one of which zeroes, backs
        through or steps: the loop repeats a line whole, so the step would run per
        micro-batch (accumulation silently gone).  None where there is none."""
        for statement in found.region:
            if not isinstance(statement, cst.SimpleStatementLine) or len(statement.body) < 2:
                continue
            for call in collect(statement, cst.Call):
                if isinstance(call.func, cst.Attribute) and \
                        call.func.attr.value in ("zero_grad", "backward", "step"):
                    return (f"line {self.line(statement)} holds several statements "
                            f"(`{self._code(statement).strip()}`)")
        return None

    def _code(self, node) -> str:
        return self.module.code_for_node(node).strip()

class ScriptNotUnderstood(Exception):
    ORDER = ("optimizer", "model", "backward", "step")

    def __init__(self, filename: str, problems: dict[str, str]):
        self.problems = problems
        lines = [f"cannot rewrite {filename}: memadvisor did not find "
                 + ", ".join(k for k in self.ORDER if k in problems)]
        lines += [f"  {k}: {problems[k]}" for k in self.ORDER if k in problems]
        super().__init__("\n".join(lines))


_MOVES = {"to", "cuda", "xpu", "npu"}


def _moves(statement: cst.SimpleStatementLine, model: str) -> bool:
    """``<model>.to(...)`` / ``.cuda(...)``, alone or assigned back to ``<model>``."""
    if len(statement.body) != 1:
        return False
    small = statement.body[0]
    if isinstance(small, cst.Assign):
        if len(small.targets) != 1 or dotted(small.targets[0].target) != model:
            return False
        call = small.value
    elif isinstance(small, cst.Expr):
        call = small.value
    else:
        return False
    return (isinstance(call, cst.Call) and isinstance(call.func, cst.Attribute)
            and call.func.attr.value in _MOVES and dotted(call.func.value) == model)
