"""Syntax helpers shared by the script search (libcst nodes in, names and nodes out)."""
from __future__ import annotations

import re

import libcst as cst

#: optimizer classes recognised by bare name (``from torch.optim import AdamW``)
TORCH_OPTIMIZERS = {
    "SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam",
    "ASGD", "Rprop", "LBFGS", "SparseAdam", "Adafactor", "Muon",
}
MARKER = re.compile(r"#\s*memadvisor:\s*(model|optimizer|forward|batch)\b")
OPTIM_CALL = re.compile(r"(^|\.)optim(izers?)?\.[A-Za-z_]\w*$")
SCOPES = (cst.FunctionDef, cst.ClassDef, cst.Lambda)
LOOPS = (cst.For, cst.While)


class NotFound(Exception):
    """One thing the rewrite needs and did not find, with how to mark it."""

    def __init__(self, what: str, message: str):
        super().__init__(message)
        self.what = what


def dotted(node) -> str | None:
    """'a.b.c' for a Name/Attribute chain, else None."""
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        base = dotted(node.value)
        return f"{base}.{node.attr.value}" if base else None
    return None


def last_part(text: str | None) -> str | None:
    return text.rsplit(".", 1)[-1] if text else None


def same_object(text: str | None, reference: str) -> bool:
    """``opt`` matches ``opt`` and ``self.opt``: scripts pass the object to helpers under the
    name it was created with, or keep it on ``self``."""
    return text is not None and (text == reference or last_part(text) == last_part(reference))


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
