"""The rewrite's edit for ``pp`` with a loss the script computes (loss_expression.py finds
what moves): the loss function built from the script's own statements, and the model called
through ``mem.with_loss``.  libcst nodes in, nodes out."""
from __future__ import annotations

import libcst as cst

from .loss_expression import OUTPUT_NAME, LossFunction
from .syntax import collect, dotted


class _ReplaceCall(cst.CSTTransformer):
    def __init__(self, call, replacement):
        self.call, self.replacement = call, replacement

    def leave_Call(self, original, updated):
        return self.replacement if original is self.call else updated


def pipeline_statements(loss: LossFunction, updated: list, alias: str) -> list:
    """The loss function (from the statements as the rewrite has edited them: the batch
    names renamed) and the statement calling the model through ``mem.with_loss``."""
    first = updated[0]
    call = next(c for c in collect(first, cst.Call)
                if _same_call(c, loss.call))
    small = first.body[0] if isinstance(first, cst.SimpleStatementLine) else None
    body = list(updated[1:])
    if not (isinstance(small, cst.Assign) and small.value is call
            and loss.output != OUTPUT_NAME):
        body.insert(0, first.visit(_ReplaceCall(call, cst.Name(loss.output)))
                    .with_changes(leading_lines=()))
    body.append(cst.SimpleStatementLine([cst.Return(cst.Name(loss.loss))]))
    params = [cst.Param(cst.Name(n)) for n in (loss.output, *loss.targets)]
    function = cst.FunctionDef(
        name=cst.Name(loss.function_name), params=cst.Parameters(params),
        body=cst.IndentedBlock(body=body), leading_lines=first.leading_lines)
    args = [cst.Arg(call.func), cst.Arg(cst.Name(loss.function_name)),
            *(cst.Arg(cst.Name(t)) for t in loss.targets)]
    if loss.context is not None:  # as the script has it: evaluated where the forward runs
        context = first.items[0].item
        args.append(cst.Arg(cst.Lambda(cst.Parameters(), context), keyword=cst.Name("context"),
                            equal=cst.AssignEqual(cst.SimpleWhitespace(""),
                                                  cst.SimpleWhitespace(""))))
    with_loss = cst.Call(func=cst.Attribute(cst.Name(alias), cst.Name("with_loss")),
                         args=_commas(args))
    statement = cst.SimpleStatementLine([cst.Assign(
        targets=[cst.AssignTarget(cst.Name(loss.loss))],
        value=call.with_changes(func=with_loss))])
    return [function, statement]


def _same_call(candidate: cst.Call, original: cst.Call) -> bool:
    """The edited copy of the model call: renames change names, not the callee or the
    number of arguments."""
    return (dotted(candidate.func) == dotted(original.func)
            and len(candidate.args) == len(original.args))


def _commas(args: list[cst.Arg]) -> list[cst.Arg]:
    return [a.with_changes(comma=cst.MaybeSentinel.DEFAULT if i == len(args) - 1 else
                           cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
            for i, a in enumerate(args)]
