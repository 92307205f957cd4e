"""``pp=P`` with a loss the script computes from the model's output: the script's loss
expression becomes the pipeline's loss function.

A pipeline runs the model's forward one micro-batch at a time inside the schedule, and only
its last stage holds the model's output; a loss the script computes after the model call::

    logits = model(inputs)
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))
    loss.backward()

must therefore run there, per micro-batch, as torchtitan hands its schedule a ``loss_fn``.
The rewrite moves the statements from the model call to the backward into a function of
the model's output and of the batch tensors they read (each cut into the same micro-batches
as the model's inputs at run time), and calls the model through ``mem.with_loss``::

    def memadvisor_loss(logits, labels):
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))
        return loss
    loss = mem.with_loss(model, memadvisor_loss, labels)(inputs)
    mem.backward(loss)

Done in the rewrite rather than at run time because the expression is code, not data: at run
time the model's output would have to be a stand-in that records what the script does with
it (fragile: Python control flow, ``.item()``, shapes); here the script's own statements run
unchanged on real tensors, and what cannot move is known before anything runs.  What can
move: assignments to plain names, reading the model's output, the batch, and anything bound
before the model call; the autocast pattern, ``with CONTEXT:`` around the model call and
the loss, stays in the function, and the pipeline enters ``CONTEXT`` around every stage's
forward (``context=``).  Refused, naming the line: any other statement (a call for its
effect, ``total += ...``, an attribute or item assignment: they would run on one rank, once
per micro-batch), reading the model itself (``model.aux_loss``: its state lives on several
stages), a name the expression binds read after it (``logits`` for an accuracy: it exists
on the last stage only), a loss that is not a name, the model call in any other block.

Pure syntax (libcst); nothing is imported or run.  ``mem.with_loss`` on a plan without
``pp`` computes the same function on the model's output, so the rewritten script runs
under any plan.
"""
from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from .syntax import SCOPES, bound_names, collect, dotted, last_part, same_object

FUNCTION_NAME = "memadvisor_loss"
OUTPUT_NAME = "memadvisor_output"  #: the parameter for the output when it has no name


class NotPipelinable(Exception):
    """The loss expression cannot become the pipeline's loss function (message: why, with
    the line)."""


@dataclass
class LossFunction:
    """What the rewrite moves into the loss function (original nodes, by identity)."""
    statements: list  #: from the statement calling the model to the last before the backward
    call: cst.Call  #: the model call in ``statements[0]``
    loss: str  #: the name ``.backward()`` is called on
    targets: list[str]  #: batch names the expression reads (as the micro-batch loop names them)
    output: str  #: the function's first parameter: the name the output is assigned to
    function_name: str = FUNCTION_NAME
    #: ``with CONTEXT:`` around the model call and (part of) the loss (autocast): the
    #: pipeline enters it around each stage's forward, the function around the loss
    context: cst.BaseExpression | None = None


def _is_model_call(call: cst.Call, models: list[str]) -> bool:
    func = dotted(call.func)
    return any(same_object(func, m) or func in (f"{m}.forward", f"{last_part(m)}.forward")
               for m in models)


def _bound(statement) -> list[str]:
    """Names an allowed loss statement binds (None for statements that are not allowed)."""
    small = statement.body[0]
    if isinstance(small, cst.Assign):
        return [n for t in small.targets for n in bound_names(t.target)]
    return bound_names(small.target)


def _plain_targets(small) -> bool:
    """Every target of the assignment is a name (or a tuple/list/starred of names)."""
    def plain(node):
        if isinstance(node, cst.Name):
            return True
        if isinstance(node, (cst.Tuple, cst.List)):
            return all(plain(e.value) for e in node.elements)
        if isinstance(node, cst.StarredElement):
            return plain(node.value)
        return False
    if isinstance(small, cst.Assign):
        return all(plain(t.target) for t in small.targets)
    return plain(small.target)


def analyse(finder, found, plan_text: str) -> LossFunction | None:
    """The loss function to build for ``found``'s region (None: the model's output holds
    the loss -- ``_, loss = model(x, y)`` -- and the pipeline picks it out at run time).
    NotPipelinable when the expression cannot move, naming the line."""
    models = [p.model for p in found.pairs]
    skip = {id(s) for s in (*found.hoisted, *found.after)}
    backward = found.backwards[0]
    backward_statement = finder.statement_of(backward.expr)
    inside = [s for s in found.region if id(s) not in skip and s is not backward_statement]
    holders = [s for s in inside if any(_is_model_call(c, models)
                                        for c in collect(s, cst.Call))]
    if not holders:
        if any(_is_model_call(c, models) for c in collect(backward_statement, cst.Call)):
            raise NotPipelinable(
                f"pp ({plan_text}): line {finder.line(backward_statement)}: "
                f"`{_first_line(finder, backward_statement)}` calls the model and the "
                "backward in one expression; assign the loss to a name first so the "
                "pipeline's loss function can return it")
        return None  # no model call in the region: the run-time checks say what is wrong
    first = holders[0]
    statements = inside[inside.index(first):]
    where = f"pp ({plan_text}): line {finder.line(first)}"
    context = None
    checked = list(statements)  #: the statements checked one by one: a with block's body
    if not isinstance(first, cst.SimpleStatementLine):
        try:
            context, body = _context(finder, first, models, where)
        except NotPipelinable:
            if len(statements) == 1 and _binds_directly(finder, first, models, backward.loss):
                return None  # the output holds the loss (checked at run time)
            raise
        checked = [*body, *statements[1:]]
    calls = [c for c in collect(first, cst.Call) if _is_model_call(c, models)]
    if len(calls) > 1:
        raise NotPipelinable(f"{where}: the model is called {len(calls)} times in one "
                             "statement; a pipeline runs one forward per micro-batch")
    call = calls[0]
    if len(checked) == 1 and _binds_directly(finder, checked[0], models, backward.loss):
        return None  # ``_, loss = model(x, y)`` (in ``with ctx:`` too): the output's loss
    if not isinstance(backward.loss, cst.Name):
        raise NotPipelinable(
            f"pp ({plan_text}): line {finder.line(backward_statement)}: "
            f"`{_code(finder, backward.loss)}.backward()` is called on an expression; assign "
            "the loss to a name first so the pipeline's loss function can return it")
    bound: set[str] = set()
    for statement in checked:
        _check_statement(finder, statement, bound, plan_text)
        _check_reads_no_model(finder, statement, call, models, plan_text)
        bound |= set(_bound(statement))
    if backward.loss.value not in bound:
        raise NotPipelinable(
            f"pp ({plan_text}): line {finder.line(backward_statement)}: the loss "
            f"`{backward.loss.value}` is not assigned between the model call (line "
            f"{finder.line(first)}) and the backward, so it cannot be computed per micro-batch")
    _check_not_read_later(finder, statements, bound - {backward.loss.value}, plan_text)
    small = checked[0].body[0]
    output = OUTPUT_NAME
    if (context is None and isinstance(small, cst.Assign) and small.value is call
            and len(small.targets) == 1 and isinstance(small.targets[0].target, cst.Name)):
        output = small.targets[0].target.value
    batch = set(found.batch)
    targets = []
    for statement in statements:
        for name in _reads(finder, statement, exclude=call):
            renamed = found.renames.get(name, name)
            if name in batch and renamed not in targets:
                targets.append(renamed)
    taken = {n.value for n in finder.nodes(cst.Name)}
    return LossFunction(statements, call, backward.loss.value, targets, output,
                        _free(FUNCTION_NAME, taken), context)


def _context(finder, statement, models, where: str):
    """``with CONTEXT:`` whose body starts with the model call (the autocast pattern):
    the context expression and the body's statements; NotPipelinable for other blocks."""
    body = getattr(getattr(statement, "body", None), "body", ())
    holds_call = bool(body) and any(_is_model_call(c, models) for c in collect(body[0], cst.Call))
    if not (isinstance(statement, cst.With) and statement.asynchronous is None
            and len(statement.items) == 1 and statement.items[0].asname is None
            and isinstance(statement.body, cst.IndentedBlock) and holds_call):
        raise NotPipelinable(
            f"{where}: the model is called inside a `{_keyword(statement)}` block; the "
            "pipeline computes the script's loss on its last stage per micro-batch, from "
            "statements that assign names only, under at most one `with CONTEXT:` (no `as`) "
            "that begins with the model call (move the model call and the loss out of the "
            "block)")
    return statement.items[0].item, list(body)


def _free(name: str, taken: set[str]) -> str:
    while name in taken:
        name += "_"
    return name


def _keyword(statement) -> str:
    return type(statement).__name__.lower().replace("statement", "")


def _code(finder, node) -> str:
    return finder.module.code_for_node(node).strip()


def _binds_directly(finder, statement, models, loss) -> bool:
    """``statement`` is (or holds) ``TARGETS = model(...)`` binding the loss's name: the
    model's own output carries the loss (the GPT example, nanoGPT)."""
    name = loss.value if isinstance(loss, cst.Name) else None
    for small in collect(statement, cst.Assign):
        if (isinstance(small.value, cst.Call) and _is_model_call(small.value, models)
                and name in _bound_by(small)):
            return True
    return False


def _bound_by(small: cst.Assign) -> list[str]:
    return [n for t in small.targets for n in bound_names(t.target)]


def _check_statement(finder, statement, bound: set[str], plan_text: str) -> None:
    where = f"pp ({plan_text}): line {finder.line(statement)}"
    if not isinstance(statement, cst.SimpleStatementLine) or len(statement.body) != 1:
        raise NotPipelinable(
            f"{where}: `{_first_line(finder, statement)}` between the model call and the "
            "backward is not one assignment; the pipeline computes the loss on its last "
            "stage per micro-batch, so only assignments to names can move there")
    small = statement.body[0]
    if isinstance(small, cst.AugAssign):
        target = small.target
        if isinstance(target, cst.Name) and target.value in bound:
            return
        raise NotPipelinable(
            f"{where}: `{_code(finder, small)}` updates `{_code(finder, target)}`, made "
            "before the model call; under a pipeline it would run on the last stage once per "
            "micro-batch (move it after the backward, reading the step's loss)")
    if isinstance(small, cst.AnnAssign) and small.value is None:
        return
    if not isinstance(small, (cst.Assign, cst.AnnAssign)):
        raise NotPipelinable(
            f"{where}: `{_code(finder, small)}` between the model call and the backward is "
            "not an assignment; under a pipeline it would run on the last stage once per "
            "micro-batch (move it before the model call or after the backward)")
    if not _plain_targets(small):
        raise NotPipelinable(
            f"{where}: `{_code(finder, small)}` assigns to an attribute or item (state "
            "outside the loss); under a pipeline it would run on the last stage once per "
            "micro-batch (move it after the backward)")


def _first_line(finder, statement) -> str:
    return _code(finder, statement).splitlines()[0]


def _check_reads_no_model(finder, statement, call, models, plan_text) -> None:
    for node in collect(statement, (cst.Name, cst.Attribute)):
        if _inside(finder, node, call) or _is_callee_of(finder, node, call):
            continue
        parent = finder.parents.get(node)
        if isinstance(node, cst.Name) and (
                (isinstance(parent, cst.Attribute) and parent.attr is node)
                or (isinstance(parent, cst.Arg) and parent.keyword is node)):
            continue  # ``x.model``, ``f(model=...)``: another object's name
        text = dotted(node)
        if text is None:
            continue
        if any(text == m or text.startswith(m + ".") for m in models):
            raise NotPipelinable(
                f"pp ({plan_text}): line {finder.line(statement)}: the loss reads "
                f"`{text}`, the model itself, whose layers and state are split over the "
                "stages; only the model's output reaches the last stage's loss function")


def _is_callee_of(finder, node, call) -> bool:
    while node is not None and node is not call:
        if node is call.func:
            return True
        node = finder.parents.get(node)
    return False


def _inside(finder, node, ancestor) -> bool:
    while node is not None:
        if node is ancestor:
            return True
        node = finder.parents.get(node)
    return False


def _reads(finder, statement, exclude=None) -> list[str]:
    """Names ``statement`` reads (not attribute names, keywords or assignment targets),
    outside ``exclude``, in source order."""
    names = []
    for name in collect(statement, cst.Name):
        if exclude is not None and _inside(finder, name, exclude):
            continue
        parent = finder.parents.get(name)
        if isinstance(parent, cst.Attribute) and parent.attr is name:
            continue
        if isinstance(parent, cst.Arg) and parent.keyword is name:
            continue
        if finder._in_target(name) or isinstance(parent, (cst.AugAssign, cst.AnnAssign)) \
                and parent.target is name:
            continue
        names.append(name.value)
    return list(dict.fromkeys(names))


def _check_not_read_later(finder, statements, names: set[str], plan_text: str) -> None:
    """A name the loss expression binds, read elsewhere in its scope and bound nowhere else
    there, would read nothing (or another step's value) after the rewrite: under a pipeline
    it exists on the last stage, inside the schedule, only."""
    if not names:
        return
    scope = finder.enclosing(statements[0], SCOPES)
    moved = {id(n) for s in statements
             for n in collect(s, (cst.SimpleStatementLine, cst.BaseCompoundStatement))}
    bound_elsewhere: set[str] = set()
    reads: list[tuple[str, object]] = []
    for statement in finder.statements:
        if id(statement) in moved or not finder._inside(statement, scope):
            continue
        if isinstance(statement, cst.SimpleStatementLine):
            bound_elsewhere |= set(finder._written(statement))
            for name in _reads(finder, statement):
                reads.append((name, statement))
        else:  # a compound statement's own header (its body's statements come on their own)
            bound_elsewhere |= set(_header_bound(statement))
            for header in _headers(statement):
                for name in _reads(finder, header):
                    reads.append((name, statement))
    for name, statement in reads:
        if name in names and name not in bound_elsewhere:
            raise NotPipelinable(
                f"pp ({plan_text}): line {finder.line(statement)} reads `{name}`, which the "
                f"loss expression (line {finder.line(statements[0])}) computes; under a "
                "pipeline it exists only on the last stage, per micro-batch, inside the "
                "schedule (use the loss, or compute it from the loss)")


def _header_bound(statement) -> list[str]:
    """Names a compound statement's header binds (a for loop's target, ``with ... as``)."""
    if isinstance(statement, cst.For):
        return bound_names(statement.target)
    if isinstance(statement, cst.With):
        return [n for item in statement.items if item.asname is not None
                for n in bound_names(item.asname.name)]
    return []


def _headers(statement) -> list:
    """The parts of a compound statement outside its body (a test, an iterable, items)."""
    if isinstance(statement, (cst.If, cst.While)):
        return [statement.test]
    if isinstance(statement, cst.For):
        return [statement.iter]
    if isinstance(statement, cst.With):
        return [item.item for item in statement.items]
    return []
