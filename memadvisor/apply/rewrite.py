"""Rewrite a training script to call ``memadvisor.apply`` (libcst keeps everything else).

The edits, and nothing else::

    import memadvisor.apply as mem                                  # after the imports
    model, optimizer = mem.prepare(model, optimizer, plan="...")  # after the optimizer
    optimizer.zero_grad()                     # moved out of the loop below, if it was inside
    for x, y in mem.micro_batches(x, y):      # forward .. backward, indented once
        loss = criterion(model(x), y)
        mem.backward(loss)                    # was loss.backward()
    mem.clip_grad_norm_(...)                  # was torch.nn.utils.clip_grad_norm_(...)
    mem.step(optimizer)                       # was optimizer.step()

The structure does not depend on the plan (the plan is one string literal), so switching
plans changes one line, and a script rewritten before only gets its plan literal replaced.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field

import libcst as cst

from ..errors import UserError
from ..plan import Plan
from .find import Found, ScriptFinder, ScriptNotUnderstood, dotted

ALIAS = "mem"
MAX_LINE = 99  #: a longer prepare line is wrapped
RUNTIME_MODULE = "memadvisor.apply"


class RewriteError(UserError):
    """The script cannot be rewritten; the message says what was missing and how to mark it."""


@dataclass
class Rewrite:
    original: str
    code: str
    plan: Plan
    found: dict[str, str] = field(default_factory=dict)  #: what -> where, for the report
    updated_plan_only: bool = False

    def diff(self, original_name: str = "a/script.py", new_name: str = "b/script.py") -> str:
        return "".join(difflib.unified_diff(
            self.original.splitlines(keepends=True), self.code.splitlines(keepends=True),
            original_name, new_name))


def rewrite_source(source: str, plan: Plan, filename: str = "script.py") -> Rewrite:
    try:
        compile(source, filename, "exec", dont_inherit=True)  # Python's own words for errors
        module = cst.parse_module(source)
    except SyntaxError as exc:
        raise RewriteError(f"cannot parse {filename}: line {exc.lineno}: {exc.msg} "
                           "(nothing was written or run)") from None
    except cst.ParserSyntaxError as exc:
        raise RewriteError(f"cannot parse {filename}: line {exc.editor_line}: "
                           f"{str(exc.message).splitlines()[0]}") from None
    from . import frameworks  # HF Trainer, Lightning, accelerate: their own knobs, no loop edits
    if frameworks.detect(module, filename) is not None:
        return frameworks.rewrite(module, source, plan, filename)
    finder = ScriptFinder(module, filename)
    existing = _existing_prepare(finder)
    if existing is not None:
        return _update_plan(module, source, plan, existing)
    try:
        found = finder.find()
    except ScriptNotUnderstood as exc:
        raise RewriteError(str(exc)) from None
    alias = _free_alias(finder)
    new_module = finder.module.visit(
        _Editor(found, plan, alias, _import_anchor(finder.module), finder.parents))
    return Rewrite(source, new_module.code, plan, found={
        "model": found.model, "optimizer": found.optimizer, "batch": ", ".join(found.batch),
        **{k: f"line {v}" for k, v in found.lines.items()}})


# --- the edits ----------------------------------------------------------------------------
def _statement(code: str) -> cst.SimpleStatementLine:
    return cst.parse_statement(code)


class _Editor(cst.CSTTransformer):
    def __init__(self, found: Found, plan: Plan, alias: str, import_anchor, parents):
        self.found = found
        self.parents = parents
        self._in_region = 0
        self.alias = alias
        self.plan_literal = _string_literal(str(plan))
        self.import_anchor = import_anchor
        self.steps = {id(e) for e in found.steps}
        self.clips = {id(c) for c in found.clips}
        self.region = {id(s) for s in found.region}
        self.hoisted = {id(s) for s in found.hoisted}
        self.indents: dict = {}  #: block -> its absolute indentation
        self._depth: list[str] = []

    def visit_IndentedBlock(self, node):
        indent = node.indent if node.indent is not None else "    "
        self._depth.append(indent)
        self.indents[node] = "".join(self._depth)
        return True

    # small replacements --------------------------------------------------------------
    def on_visit(self, node):
        if id(node) in self.region:
            self._in_region += 1
        return super().on_visit(node)

    def on_leave(self, original, updated):
        if id(original) in self.region:
            self._in_region -= 1
        return super().on_leave(original, updated)

    def leave_Name(self, original, updated):
        new = self.found.renames.get(original.value) if self._in_region else None
        if new is None:
            return updated
        parent = self.parents.get(original)
        if (isinstance(parent, cst.Attribute) and parent.attr is original) or (
                isinstance(parent, cst.Arg) and parent.keyword is original) or isinstance(
                parent, cst.Param):
            return updated
        return updated.with_changes(value=new)

    def leave_Expr(self, original, updated):
        if original is self.found.backward:
            call = updated.value
            loss = call.func.value
            args = [cst.Arg(loss), *call.args]
            return updated.with_changes(value=cst.Call(
                func=self._runtime("backward"), args=_commas(args)))
        if id(original) in self.steps:
            optimizer = updated.value.func.value
            return updated.with_changes(value=cst.Call(
                func=self._runtime("step"), args=[cst.Arg(optimizer)]))
        return updated

    def leave_Call(self, original, updated):
        if id(original) in self.clips:
            name = dotted(original.func).rpartition(".")[2]
            return updated.with_changes(func=self._runtime(name))
        return updated

    def _runtime(self, name: str) -> cst.Attribute:
        return cst.Attribute(value=cst.Name(self.alias), attr=cst.Name(name))

    # statement lists ------------------------------------------------------------------
    def leave_IndentedBlock(self, original, updated):
        result = updated.with_changes(body=self._edit_body(original, updated))
        self._depth.pop()
        return result

    def leave_Module(self, original, updated):
        return updated.with_changes(body=self._edit_body(original, updated))

    def _edit_body(self, original, updated) -> list:
        body = []
        pairs = list(zip(original.body, updated.body))
        index = 0
        while index < len(pairs):
            old, new = pairs[index]
            if id(old) in self.region:
                count = len(self.found.region)
                body.extend(self._micro_batch_loop([n for _, n in pairs[index: index + count]],
                                                   [o for o, _ in pairs[index: index + count]]))
                index += count
                continue
            body.append(new)
            if old is self.import_anchor:
                body.append(_statement(f"import {RUNTIME_MODULE} as {self.alias}\n"))
            if old is self.found.optimizer_statement:
                body.append(self._prepare_statement(len(self._indent_of(original))))
            index += 1
        if isinstance(original, cst.Module) and self.import_anchor is None:
            body.insert(0, _statement(f"import {RUNTIME_MODULE} as {self.alias}\n"))
        return body

    def _prepare_statement(self, indent: int) -> cst.SimpleStatementLine:
        model, optimizer = self.found.model, self.found.optimizer
        call = f"{self.alias}.prepare({model}, {optimizer}, plan={self.plan_literal})"
        line = f"{model}, {optimizer} = {call}\n"
        if indent + len(line) > MAX_LINE:  # the way black would wrap it
            line = (f"{model}, {optimizer} = {self.alias}.prepare(\n"
                    f"    {model}, {optimizer}, plan={self.plan_literal}\n)\n")
        return _statement(line)

    def _indent_of(self, block) -> str:
        if isinstance(block, cst.Module):
            return ""
        return self.indents.get(block, "    ")

    def _micro_batch_loop(self, new_statements, old_statements) -> list:
        hoisted, inside = [], []
        carry_lines = None
        for old, new in zip(old_statements, new_statements):
            if id(old) in self.hoisted:
                hoisted.append(new.with_changes(leading_lines=()))
                carry_lines = new.leading_lines
                continue
            if carry_lines is not None:
                new = new.with_changes(leading_lines=carry_lines)
                carry_lines = None
            inside.append(new)
        lead = inside[0].leading_lines
        inside[0] = inside[0].with_changes(leading_lines=())
        names = ", ".join(self.found.batch)
        targets = ", ".join(self.found.renames.get(n, n) for n in self.found.batch)
        loop = cst.parse_statement(
            f"for {targets} in {self.alias}.micro_batches({names}):\n    pass\n")
        loop = loop.with_changes(body=loop.body.with_changes(body=inside))
        if hoisted:
            hoisted[0] = hoisted[0].with_changes(leading_lines=lead)
            return [*hoisted, loop]
        return [loop.with_changes(leading_lines=lead)]


def _commas(args: list[cst.Arg]) -> list[cst.Arg]:
    fixed = []
    for i, arg in enumerate(args):
        last = i == len(args) - 1
        fixed.append(arg.with_changes(comma=cst.MaybeSentinel.DEFAULT if last else cst.Comma(
            whitespace_after=cst.SimpleWhitespace(" "))))
    return fixed


def _string_literal(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _free_alias(finder: ScriptFinder) -> str:
    used = {n.value for n in finder.nodes(cst.Name)}
    for alias in (ALIAS, "memadvisor_apply", "_memadvisor_apply"):
        if alias not in used:
            return alias
    raise RewriteError("the script uses every name memadvisor would import its runtime as")


def _import_anchor(module: cst.Module):
    """The last import of the module's opening run of docstring/imports, else the docstring
    (None: insert first)."""
    anchor = None
    for statement in module.body:
        if isinstance(statement, cst.SimpleStatementLine) and all(
                isinstance(s, (cst.Import, cst.ImportFrom)) for s in statement.body):
            anchor = statement
            continue
        if (anchor is None and statement is module.body[0]
                and isinstance(statement, cst.SimpleStatementLine) and len(statement.body) == 1
                and isinstance(statement.body[0], cst.Expr)
                and isinstance(statement.body[0].value, (cst.SimpleString,
                                                         cst.ConcatenatedString))):
            anchor = statement  # the docstring stays first
            continue
        break
    return anchor


# --- a script rewritten before: replace the plan literal --------------------------------
def _existing_prepare(finder: ScriptFinder):
    imports_runtime = any(
        dotted(alias.name) == RUNTIME_MODULE
        for node in finder.nodes(cst.Import) for alias in node.names)
    if not imports_runtime:
        return None
    for call in finder.nodes(cst.Call):
        if isinstance(call.func, cst.Attribute) and call.func.attr.value == "prepare":
            for arg in call.args:
                if arg.keyword is not None and arg.keyword.value == "plan":
                    return arg
    return None


class _PlanReplacer(cst.CSTTransformer):
    def __init__(self, target, literal):
        self.target, self.literal = target, literal

    def leave_Arg(self, original, updated):
        if original is self.target:
            return updated.with_changes(value=cst.SimpleString(self.literal))
        return updated


def _update_plan(module, source, plan, plan_arg) -> Rewrite:
    new = module.visit(_PlanReplacer(plan_arg, _string_literal(str(plan))))
    return Rewrite(source, new.code, plan, found={"plan": "updated the existing prepare call"},
                   updated_plan_only=True)
