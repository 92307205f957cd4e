"""Syntax helpers shared by the framework rewrites: which library a call comes from, the
user's configuration calls, and the keyword edits made to them (libcst keeps the rest).

A framework rewrite edits *configuration lines* only (``TrainingArguments(...)``,
``Trainer(...)``, ``Accelerator(...)``, a ``DataLoader(batch_size=...)``): each edit is a
keyword set to a value, so the diff reads as the knobs the plan turns.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import libcst as cst
from libcst.metadata import MetadataWrapper, ParentNodeProvider, PositionProvider

from ..find import dotted

RUNTIME_MODULE = "memadvisor.apply.frameworks"


class Script:
    """A parsed script with what the framework rewrites ask of it: imports resolved to
    qualified names, each node's parent and line."""

    def __init__(self, module: cst.Module, filename: str):
        self.filename = filename
        wrapper = MetadataWrapper(module, unsafe_skip_copy=True)
        self.module = wrapper.module
        self.positions = wrapper.resolve(PositionProvider)
        self.parents = wrapper.resolve(ParentNodeProvider)
        self.imports = _imported_names(self.module)

    def nodes(self, kind) -> list:
        found = []

        class _Collect(cst.CSTVisitor):
            def on_visit(self, node):
                if isinstance(node, kind):
                    found.append(node)
                return True

        self.module.visit(_Collect())
        return found

    def line(self, node) -> int:
        return self.positions[node].start.line

    def qualified(self, node) -> str | None:
        """``transformers.Trainer`` for ``Trainer`` imported from transformers, ``lightning.
        Trainer`` for ``L.Trainer`` after ``import lightning as L``; None when not imported."""
        text = dotted(node)
        if text is None:
            return None
        head, _, rest = text.partition(".")
        origin = self.imports.get(head)
        if origin is None:
            return None
        return f"{origin}.{rest}" if rest else origin

    def calls_to(self, accept: Callable[[str], bool]) -> list[cst.Call]:
        return [c for c in self.nodes(cst.Call)
                if (name := self.qualified(c.func)) is not None and accept(name)]

    def the_one_call(self, accept: Callable[[str], bool], what: str) -> cst.Call:
        """The single call ``accept`` names (the configuration line a plan edits); a
        RewriteError naming the lines when there is none or several."""
        from ..rewrite import RewriteError
        calls = self.calls_to(accept)
        if len(calls) != 1:
            lines = ", ".join(str(self.line(c)) for c in calls) or "-"
            found = "no such call" if not calls else f"{len(calls)} calls"
            raise RewriteError(f"{self.filename}: {what}: {found} found (lines {lines}); "
                               "memadvisor edits exactly one")
        return calls[0]

    def imports_module(self, prefix: str) -> bool:
        return any(v == prefix or v.startswith(prefix + ".") for v in self.imports.values())

    def enclosing(self, node, kind):
        parent = self.parents.get(node)
        while parent is not None and not isinstance(parent, kind):
            parent = self.parents.get(parent)
        return parent


def _imported_names(module: cst.Module) -> dict[str, str]:
    """Local name -> qualified name, for every import statement anywhere in the script."""
    names: dict[str, str] = {}

    class _Imports(cst.CSTVisitor):
        def visit_Import(self, node):
            for alias in node.names:
                full = dotted(alias.name)
                if alias.asname is not None:
                    names[alias.asname.name.value] = full
                else:
                    names[full.split(".")[0]] = full.split(".")[0]

        def visit_ImportFrom(self, node):
            if node.relative or node.module is None or isinstance(node.names, cst.ImportStar):
                return
            base = dotted(node.module)
            for alias in node.names:
                name = dotted(alias.name)
                local = alias.asname.name.value if alias.asname is not None else name
                names[local] = f"{base}.{name}"

    module.visit(_Imports())
    return names


def keyword(call: cst.Call, name: str) -> cst.Arg | None:
    return next((a for a in call.args if a.keyword is not None and a.keyword.value == name), None)


def has_star_kwargs(call: cst.Call) -> bool:
    return any(a.star == "**" for a in call.args)


def literal(node) -> object:
    """The Python value of a literal argument (``True``, ``4``, ``"x"``), else a marker."""
    try:
        import ast
        return ast.literal_eval(cst.Module([]).code_for_node(node))
    except (ValueError, SyntaxError):
        return NOT_LITERAL


NOT_LITERAL = object()


def cpu_switch(call: cst.Call, name: str, alias: str) -> str | None:
    """The code for a framework's "train on the CPU" keyword (``Accelerator(cpu=)``,
    ``TrainingArguments(use_cpu=)``) that lets a data-parallel plan distribute on a machine
    without CUDA, where it trains nothing distributed otherwise; asked when the script
    runs, so a GPU machine still uses its GPUs.  None where the script writes a literal
    there (its own decision; the check at the first step says when it kept the plan from
    taking effect).  An expression (``cpu=args.cpu``, accelerate's examples) is kept and
    or-ed with it."""
    existing = keyword(call, name)
    if existing is None:
        return f"{alias}.without_cuda()"
    if literal(existing.value) is not NOT_LITERAL:
        return None
    return f"({source_of(existing.value)}) or {alias}.without_cuda()"


def source_of(node) -> str:
    return cst.Module([]).code_for_node(node)


@dataclass
class Edits:
    """What a framework rewrite changes: keywords per call, whole statements replaced, and
    lines added after the imports."""

    keywords: dict[int, dict[str, str]] = field(default_factory=dict)  #: id(call) -> kw -> code
    nodes: dict[int, Callable] = field(default_factory=dict)  #: id(node) -> updated -> new
    header: list[str] = field(default_factory=list)  #: statements after the imports

    def set(self, call: cst.Call, name: str, code: str) -> None:
        self.keywords.setdefault(id(call), {})[name] = code

    def apply(self, module: cst.Module) -> cst.Module:
        return module.visit(_Editor(self))


class _Editor(cst.CSTTransformer):
    def __init__(self, edits: Edits):
        self.edits = edits

    def on_leave(self, original, updated):
        updated = super().on_leave(original, updated)
        replace = self.edits.nodes.get(id(original))
        if replace is not None:
            updated = replace(updated)
        if isinstance(original, cst.Call) and id(original) in self.edits.keywords:
            updated = set_keywords(updated, self.edits.keywords[id(original)])
        return updated

    def leave_Module(self, original, updated):
        if not self.edits.header:
            return updated
        from ..rewrite import _import_anchor
        anchor = _import_anchor(original)
        body = list(updated.body)
        at = 0 if anchor is None else next(
            i for i, (old, _) in enumerate(zip(original.body, updated.body)) if old is anchor) + 1
        added = [cst.parse_statement(line + "\n") for line in self.edits.header]
        return updated.with_changes(body=[*body[:at], *added, *body[at:]])


def set_keywords(call: cst.Call, values: dict[str, str]) -> cst.Call:
    """``call`` with each keyword set to its code: replaced where present, appended (in the
    call's own comma and line-break style) where not."""
    args = list(call.args)
    for name, code in values.items():
        value = cst.parse_expression(code)
        index = next((i for i, a in enumerate(args)
                      if a.keyword is not None and a.keyword.value == name), None)
        if index is not None:
            args[index] = args[index].with_changes(value=value)
            continue
        new = cst.Arg(value=value, keyword=cst.Name(name),
                      equal=cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""),
                                            whitespace_after=cst.SimpleWhitespace("")))
        if not args:
            args = [new]
            continue
        last = args[-1]
        inner = args[-2].comma if len(args) > 1 and isinstance(args[-2].comma, cst.Comma) \
            else cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
        if isinstance(last.comma, cst.Comma):  # trailing comma: the new argument keeps it
            args[-1] = last.with_changes(comma=inner)
            args.append(new.with_changes(comma=last.comma))
        else:
            args[-1] = last.with_changes(comma=inner)
            args.append(new)
    return call.with_changes(args=args)


def string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def split_batch(edits: Edits, call: cst.Call, name: str, parts: int, default: str | None,
                alias: str, where: str) -> None:
    """Set ``name=`` (a batch size) to its value divided into ``parts``: the framework then
    feeds ``parts`` smaller batches (micro-batches and/or ranks) where it fed one, so the
    samples per optimizer step stay the same.  ``split_batch`` checks at run time that the
    value divides (a floor would change the effective batch)."""
    if parts == 1:
        return
    arg = keyword(call, name)
    if arg is None and default is None:
        from ..rewrite import RewriteError
        raise RewriteError(f"{where}: no {name}= to split into {parts} parts; "
                           f"write the batch size there")
    value = source_of(arg.value) if arg is not None else default
    edits.set(call, name, f"{alias}.split_batch({value}, parts={parts})")
