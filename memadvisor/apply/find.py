"""Find what the rewrite needs in a training script: model, optimizer, forward, backward,
step and the batch.  Pure syntax (libcst); nothing is imported or run.

What is looked for, and the comment that marks it when the search fails:

=========  ==================================================  ===========================
what       found as                                            mark with
=========  ==================================================  ===========================
optimizer  ``NAME = torch.optim.<Class>(...)`` (any ``optim.``)  ``# memadvisor: optimizer``
model      ``X`` in ``X.parameters()`` given to the optimizer   ``# memadvisor: model``
backward   the one ``<loss>.backward()`` statement              (one per script)
step       ``<optimizer>.step()``                               (same name as the optimizer)
forward    first statement calling the model, in the block      ``# memadvisor: forward``
           that holds the backward
batch      variables the forward..backward statements read      ``# memadvisor: batch``
           as data, bound in the loop (or function) before them
=========  ==================================================  ===========================
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

#: optimizer classes recognised by bare name (``from torch.optim import AdamW``)
TORCH_OPTIMIZERS = {
    "SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam",
    "ASGD", "Rprop", "LBFGS", "SparseAdam", "Adafactor", "Muon",
}
MARKER = re.compile(r"#\s*memadvisor:\s*(model|optimizer|forward|batch)\b")
_OPTIM_CALL = re.compile(r"(^|\.)optim(izers?)?\.[A-Za-z_]\w*$")
_SCOPES = (cst.FunctionDef, cst.ClassDef, cst.Lambda)
_LOOPS = (cst.For, cst.While)


class NotFound(Exception):
    """One thing the rewrite needs and did not find, with how to mark it."""

    def __init__(self, what: str, message: str):
        super().__init__(message)
        self.what = what


@dataclass
class Found:
    optimizer_statement: cst.SimpleStatementLine
    optimizer: str  #: the optimizer as the script names it, e.g. 'optimizer', 'self.opt'
    model: str  #: e.g. 'model', 'self.model'
    backward: cst.Expr  #: the ``<loss>.backward()`` expression statement
    steps: list[cst.Expr]  #: ``<optimizer>.step()`` expression statements
    clips: list[cst.Call]  #: ``torch.nn.utils.clip_grad_norm_/value_`` calls
    block: cst.CSTNode  #: IndentedBlock or Module holding the forward..backward region
    region: list[cst.CSTNode]  #: statements from the forward through the backward
    hoisted: list[cst.CSTNode]  #: ``zero_grad`` statements inside the region
    batch: list[str]  #: names the region takes the batch from
    #: batch names bound before the loop: the loop hands out parts under new names, or the
    #: next pass would split the previous pass's last part
    renames: dict[str, str] = field(default_factory=dict)
    lines: dict[str, int] = field(default_factory=dict)  #: what -> line, for the report


def dotted(node) -> str | None:
    """'a.b.c' for a Name/Attribute chain, else None."""
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        base = dotted(node.value)
        return f"{base}.{node.attr.value}" if base else None
    return None


def _last(text: str | None) -> str | None:
    return text.rsplit(".", 1)[-1] if text else None


def _same_object(text: str | None, reference: str) -> bool:
    """``opt`` matches ``opt`` and ``self.opt``: scripts pass the object to helpers under the
    name it was created with, or keep it on ``self``."""
    return text is not None and (text == reference or _last(text) == _last(reference))


class _Collector(cst.CSTVisitor):
    def __init__(self, kinds):
        self.kinds = kinds
        self.found = []

    def on_visit(self, node):
        if isinstance(node, self.kinds):
            self.found.append(node)
        return True


def collect(node: cst.CSTNode, kinds) -> list:
    visitor = _Collector(kinds)
    node.visit(visitor)
    return visitor.found


def bound_names(target) -> list[str]:
    """Names an assignment/for target binds."""
    if isinstance(target, cst.Name):
        return [target.value]
    if isinstance(target, (cst.Tuple, cst.List)):
        return [n for el in target.elements for n in bound_names(el.value)]
    if isinstance(target, cst.StarredElement):
        return bound_names(target.value)
    return []


#: methods whose arguments say how to move or reshape a tensor, not which tensor it is
_NON_DATA_METHODS = {"to", "cuda", "type", "view", "reshape", "expand", "repeat", "permute",
                     "transpose", "flatten", "unsqueeze", "squeeze", "size", "new_zeros"}
_NOT_DATA_CONTEXTS = (cst.FormattedString, cst.Comparison, cst.Lambda, cst.Param,
                      cst.SubscriptElement)


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


class ScriptFinder:
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
            wrapper = MetadataWrapper(self.module, unsafe_skip_copy=True)
            self._positions = wrapper.resolve(PositionProvider)
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

    # --- the things -------------------------------------------------------------------
    def optimizer(self) -> tuple[cst.SimpleStatementLine, str, cst.CSTNode]:
        marked, candidates = [], []
        for statement, target, value in self.assignments():
            text = self.module.code_for_node(target).strip()
            if self.marker(statement) == "optimizer":
                marked.append((statement, text, value))
            elif isinstance(value, cst.Call):
                func = dotted(value.func) or ""
                if "lr_scheduler" in func or "scheduler" in func.lower():
                    continue
                if _OPTIM_CALL.search(func) or func in TORCH_OPTIMIZERS:
                    candidates.append((statement, text, value))
        chosen = marked or candidates
        if not chosen:
            manual = any(isinstance(s, cst.AugAssign) and isinstance(s.target, cst.Name)
                         for s in self.nodes(cst.AugAssign))
            hint = (" (the script seems to update parameters by hand; memadvisor needs a "
                    "torch.optim optimizer to shard, swap or offload)" if manual else "")
            raise NotFound("optimizer", "no `NAME = torch.optim.<Class>(...)` found" + hint +
                           "; if the optimizer is made elsewhere, end the line that assigns it "
                           "with `# memadvisor: optimizer`")
        if len(chosen) > 1 and len({text for _, text, _ in chosen}) == 1:
            # one optimizer chosen by a flag (if/elif/else): prepare after the whole choice
            common = self._common_statement([statement for statement, _, _ in chosen])
            if common is not None:
                return common, chosen[0][1], chosen[0][2]
        if len(chosen) > 1:
            stepped = {dotted(e.value.func.value) for e in self.expression_calls("step")}
            with_step = [c for c in chosen if c[1] in stepped]
            if len(with_step) != 1:
                lines = ", ".join(str(self.line(c[0])) for c in chosen)
                raise NotFound("optimizer", f"{len(chosen)} optimizers (lines {lines}); a plan "
                               "applies to one model and one optimizer: mark the one to use "
                               "with `# memadvisor: optimizer`")
            chosen = with_step
        return chosen[0]

    def _common_statement(self, statements):
        """The innermost statement holding all of ``statements``, if they share one."""
        def chain(node):
            found = []
            while node is not self.module:
                node = self.parents[node]
                if isinstance(node, cst.BaseCompoundStatement):
                    found.append(node)
            return found
        shared = [n for n in chain(statements[0]) if all(n in chain(s) for s in statements[1:])]
        shared = [n for n in shared if not isinstance(n, (*_SCOPES, *_LOOPS))]
        return shared[0] if shared else None

    def model(self, optimizer_statement, optimizer_value) -> str:
        for statement, target, _ in self.assignments():
            if self.marker(statement) == "model":
                return self.module.code_for_node(target).strip()
        owners = self._parameter_owners(optimizer_value)
        if not owners:
            # the optimizer was given a name (params, groups): look where that was built
            scope = self.enclosing(optimizer_statement, _SCOPES)
            before = [s for s in collect(scope, cst.SimpleStatementLine)
                      if self.before(s, optimizer_statement)]
            for statement in before:
                owners.extend(self._parameter_owners(statement))
            for loop in collect(scope, cst.For):
                if self.before(loop, optimizer_statement):
                    owners.extend(self._parameter_owners(loop.iter))
            owners = list(dict.fromkeys(owners))
        if len(owners) != 1:
            found = f" (found {', '.join(owners)})" if owners else ""
            raise NotFound("model", "could not tell which model the optimizer trains: expected "
                           f"`MODEL.parameters()` in the optimizer's arguments{found}; end the "
                           "line that assigns the model with `# memadvisor: model`")
        return owners[0]

    def _parameter_owners(self, node) -> list[str]:
        owners = []
        for call in collect(node, cst.Call):
            if (isinstance(call.func, cst.Attribute)
                    and call.func.attr.value in ("parameters", "named_parameters")):
                owner = dotted(call.func.value)
                if owner:
                    owners.append(owner)
        return list(dict.fromkeys(owners))

    def backward(self) -> cst.Expr:
        calls = self.expression_calls("backward")
        scaled = [c for c in calls if isinstance(c.value.func.value, cst.Call)
                  and isinstance(c.value.func.value.func, cst.Attribute)
                  and c.value.func.value.func.attr.value == "scale"]
        if scaled:
            raise NotFound("backward", f"line {self.line(scaled[0])}: the script scales the "
                           "loss itself (GradScaler); remove its GradScaler/autocast and let "
                           "the plan's precision do it")
        if not calls:
            raise NotFound("backward", "no `<loss>.backward()` statement found")
        if len(calls) > 1:
            lines = ", ".join(str(self.line(c)) for c in calls)
            raise NotFound("backward", f"{len(calls)} `.backward()` calls (lines {lines}); "
                           "memadvisor rewrites scripts with one backward per step")
        return calls[0]

    def steps(self, optimizer: str) -> list[cst.Expr]:
        schedulers = {self.module.code_for_node(t).strip()
                      for _, t, v in self.assignments()
                      if isinstance(v, cst.Call) and "sched" in (dotted(v.func) or "").lower()}
        found = [e for e in self.expression_calls("step")
                 if not e.value.args and _same_object(dotted(e.value.func.value), optimizer)
                 and dotted(e.value.func.value) not in schedulers]
        for call in self.nodes(cst.Call):
            if (isinstance(call.func, cst.Attribute) and call.func.attr.value == "step"
                    and call.args and dotted(call.args[0].value) == optimizer):
                raise NotFound("step", f"line {self.line(call)}: the optimizer is stepped "
                               "through a GradScaler; remove it and let the plan's precision "
                               "scale the loss")
        if not found:
            raise NotFound("step", f"no `{optimizer}.step()` call found for the optimizer")
        return found

    def clips(self) -> list[cst.Call]:
        imported = {alias.evaluated_alias or alias.evaluated_name
                    for node in self.nodes(cst.ImportFrom)
                    if dotted(node.module) in ("torch.nn.utils", "torch.nn.utils.clip_grad")
                    and not isinstance(node.names, cst.ImportStar)
                    for alias in node.names}
        found = []
        for call in self.nodes(cst.Call):
            text = dotted(call.func) or ""
            prefix, _, name = text.rpartition(".")
            if name in ("clip_grad_norm_", "clip_grad_value_") and (
                    prefix in ("torch.nn.utils", "nn.utils") or (not prefix and text in imported)):
                found.append(call)
        return found

    def forward_region(self, backward_statement, model: str):
        block = self.parents[backward_statement]
        body = list(block.body)
        end = body.index(backward_statement)
        start = None
        for index, statement in enumerate(body[: end + 1]):
            if self.marker(statement) == "forward":
                start = index
                break
        if start is None:
            for index, statement in enumerate(body[: end + 1]):
                if any(_same_object(dotted(c.func), model) or
                       dotted(c.func) in (f"{model}.forward", f"{_last(model)}.forward")
                       for c in collect(statement, cst.Call)):
                    start = index
                    break
        if start is None:
            raise NotFound("forward", f"no call to `{model}(...)` before the backward at line "
                           f"{self.line(backward_statement)} in the same block; forward and "
                           "backward must be in one block: end the forward's first line with "
                           "`# memadvisor: forward`")
        region = body[start: end + 1]
        for statement in region:
            for jump in collect(statement, (cst.Break, cst.Continue)):
                if self.enclosing(jump, _LOOPS) is self.enclosing(backward_statement, _LOOPS):
                    raise NotFound("forward", f"line {self.line(jump)}: `break`/`continue` "
                                   "between the forward and the backward would act on the "
                                   "micro-batch loop; move it before the forward")
        return block, region

    def hoistable(self, region, optimizer: str, model: str) -> list:
        hoisted = []
        for statement in region[1:]:
            if not isinstance(statement, cst.SimpleStatementLine) or len(statement.body) != 1:
                continue
            small = statement.body[0]
            if (isinstance(small, cst.Expr) and isinstance(small.value, cst.Call)
                    and isinstance(small.value.func, cst.Attribute)
                    and small.value.func.attr.value == "zero_grad"
                    and dotted(small.value.func.value) in (optimizer, model)):
                hoisted.append(statement)
        return hoisted

    def data_names(self, statement) -> list[str]:
        """Variables ``statement`` reads as data, in source order: not a callee, not what
        ``.to(device)``/``.view(n, -1)`` are given, not inside f-strings or comparisons."""
        names = []
        for name in collect(statement, cst.Name):
            parent = self.parents.get(name)
            if isinstance(parent, cst.Attribute) and parent.attr is name:
                continue
            if isinstance(parent, cst.Call) and parent.func is name:
                continue
            if isinstance(parent, cst.Arg):
                if parent.keyword is name:
                    continue
                call = self.parents.get(parent)
                if (isinstance(call, cst.Call) and isinstance(call.func, cst.Attribute)
                        and call.func.attr.value in _NON_DATA_METHODS):
                    continue
            if isinstance(parent, (cst.AssignTarget, cst.AugAssign, cst.For, cst.AsName)):
                continue  # written, not read (targets of tuples are inside a Tuple: see below)
            if self._in_target(name) or self._inside_any(name, statement, _NOT_DATA_CONTEXTS):
                continue
            names.append(name.value)
        return list(dict.fromkeys(names))

    def _in_target(self, node) -> bool:
        while node in self.parents:
            parent = self.parents[node]
            if isinstance(parent, cst.AssignTarget) or (
                    isinstance(parent, (cst.For, cst.CompFor)) and parent.target is node):
                return True
            if not isinstance(parent, (cst.Tuple, cst.List, cst.Element, cst.StarredElement)):
                return False
            node = parent
        return False

    def _inside_any(self, node, stop, kinds) -> bool:
        while node is not stop and node in self.parents:
            node = self.parents[node]
            if isinstance(node, kinds):
                return True
        return False

    def batch(self, region, model: str, optimizer: str) -> list[str]:
        first = region[0]
        container = self.enclosing(first, _LOOPS + (cst.FunctionDef,))
        for statement, target, _ in self.assignments():
            if self.marker(statement) == "batch" and self.before(statement, first):
                return bound_names(target)
        bound = set(self._bound_before(container, first))
        excluded = {model.split(".")[0], optimizer.split(".")[0], "self", "cls"}
        used = [n for s in region for n in self.data_names(s)]
        batch = [n for n in dict.fromkeys(used) if n in bound and n not in excluded]
        if not batch:
            # a fixed batch made once before the loop (or passed to the function holding it)
            scope = self.enclosing(region[0], (cst.FunctionDef,))
            outer = set(self._bound_before(scope, first))
            batch = [n for n in dict.fromkeys(used) if n in outer and n not in excluded]
        if not batch:
            raise NotFound("batch", f"could not tell which variables hold the batch fed to "
                           f"`{model}` at line {self.line(first)}; end the line that assigns them "
                           "with `# memadvisor: batch`")
        return batch

    def _bound_before(self, container, first) -> list[str]:
        names = []
        if isinstance(container, cst.For):
            names += bound_names(container.target)
        if isinstance(container, cst.FunctionDef):
            params = container.params
            for param in (*params.posonly_params, *params.params, *params.kwonly_params):
                names.append(param.name.value)
        for statement, target, _ in self.assignments():
            if self.before(statement, first) and self._inside(statement, container):
                names += bound_names(target)
        for node in collect(container, (cst.For, cst.AugAssign, cst.WithItem)):
            if not self.before(node, first) or not self._inside(node, container):
                continue
            if isinstance(node, cst.For) and node is not container:
                names += bound_names(node.target)
            elif isinstance(node, cst.WithItem) and node.asname is not None:
                names += bound_names(node.asname.name)
        return names

    def _inside(self, node, container) -> bool:
        """``node`` is in ``container`` and not in a function or class nested in it."""
        while node is not container:
            if node is self.module:
                return container is self.module
            node = self.parents[node]
            if isinstance(node, _SCOPES) and node is not container:
                return False
        return True

    # --- everything -------------------------------------------------------------------
    def find(self) -> Found:
        problems: dict[str, str] = {}

        def attempt(what, fn, *args):
            try:
                return fn(*args)
            except NotFound as exc:
                problems.setdefault(exc.what, str(exc))
                return None

        optimizer_found = attempt("optimizer", self.optimizer)
        model = optimizer = None
        if optimizer_found:
            statement, optimizer, value = optimizer_found
            model = attempt("model", self.model, statement, value)
        backward = attempt("backward", self.backward)
        steps = attempt("step", self.steps, optimizer) if optimizer else None
        if "optimizer" in problems and not self.expression_calls("step"):
            problems.setdefault("step", "no `<optimizer>.step()` call found")
        block = region = batch = None
        if backward is not None and model:
            backward_statement = self.statement_of(backward)
            found_region = attempt("forward", self.forward_region, backward_statement, model)
            if found_region:
                block, region = found_region
                batch = attempt("batch", self.batch, region, model, optimizer)
        if problems:
            raise ScriptNotUnderstood(self.filename, problems)
        container = self.enclosing(region[0], _LOOPS + (cst.FunctionDef,))
        renames = {}
        if isinstance(container, _LOOPS):
            fresh = set(self._bound_before(container, region[0]))
            taken = {n.value for n in self.nodes(cst.Name)}
            for name in batch:
                if name not in fresh:
                    new = f"{name}_part"
                    while new in taken:
                        new += "_"
                    renames[name] = new
        return Found(
            optimizer_statement=optimizer_found[0], optimizer=optimizer, model=model,
            backward=backward, steps=steps, clips=self.clips(), block=block, region=region,
            hoisted=self.hoistable(region, optimizer, model), batch=batch, renames=renames,
            lines={"model/optimizer": self.line(optimizer_found[0]),
                   "forward": self.line(region[0]), "backward": self.line(backward),
                   "step": self.line(steps[0])},
        )


class ScriptNotUnderstood(Exception):
    ORDER = ("optimizer", "model", "forward", "backward", "step", "batch")

    def __init__(self, filename: str, problems: dict[str, str]):
        self.problems = problems
        lines = [f"cannot rewrite {filename}: memadvisor did not find "
                 + ", ".join(k for k in self.ORDER if k in problems)]
        lines += [f"  {k}: {problems[k]}" for k in self.ORDER if k in problems]
        super().__init__("\n".join(lines))
