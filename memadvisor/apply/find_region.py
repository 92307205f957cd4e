"""The region the micro-batch loop wraps (forward..backward, or a GAN's whole iteration up
to its last backward), the batch it reads, and the names its parts get.

A mixin of ``ScriptFinder`` (find.py): it uses the finder's index of the syntax tree.
"""
from __future__ import annotations

import libcst as cst

from .syntax import (
    LOOPS as _LOOPS, SCOPES as _SCOPES, NotFound, bound_names, collect, dotted,
    last_part as _last, same_object as _same_object,
)

#: methods whose arguments say how to move or reshape a tensor, not which tensor it is
_NON_DATA_METHODS = {"to", "cuda", "type", "view", "reshape", "expand", "repeat", "permute",
                     "transpose", "flatten", "unsqueeze", "squeeze", "size", "new_zeros"}
_NOT_DATA_CONTEXTS = (cst.FormattedString, cst.Comparison, cst.Lambda, cst.Param,
                      cst.SubscriptElement)


class RegionSearch:
    """Mixin: needs ``module``, ``parents``, ``order``, ``line``, ``nodes``, ``before``,
    ``marker``, ``statement_of``, ``enclosing``, ``assignments``, ``scalers``."""

    # --- the region the micro-batch loop wraps --------------------------------------
    def forward_region(self, backward_statement, models: list[str]):
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
                       for c in collect(statement, cst.Call) for model in models):
                    start = index
                    break
        if start is None:
            raise NotFound("forward", f"no call to `{models[0]}(...)` before the backward at line "
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

    def hoistable(self, region, owners: set[str]) -> list:
        hoisted = []
        for statement in region[1:]:
            if not isinstance(statement, cst.SimpleStatementLine) or len(statement.body) != 1:
                continue
            small = statement.body[0]
            if (isinstance(small, cst.Expr) and isinstance(small.value, cst.Call)
                    and isinstance(small.value.func, cst.Attribute)
                    and small.value.func.attr.value == "zero_grad"
                    and dotted(small.value.func.value) in owners):
                hoisted.append(statement)
        return hoisted

    def next_batch_fetches(self, region, batch: list[str]) -> list:
        """Statements of the region that fetch the next batch into the batch's names and
        read nothing the region made (nanoGPT prefetches ``X, Y = get_batch('train')``
        between forward and backward): they must run once per step, after the micro-batch
        loop, under the names the next step reads."""
        fetches = []
        for index, statement in enumerate(region[1:-1], start=1):
            if not isinstance(statement, cst.SimpleStatementLine):
                continue
            written = [n for small in statement.body if isinstance(small, cst.Assign)
                       for t in small.targets for n in bound_names(t.target)]
            if not written or not set(written) & set(batch):
                continue
            made_before = {n for s in region[:index] for n in self._written(s)}
            read_after = {n for s in region[index + 1:] for n in self.data_names(s)}
            if not (set(self.data_names(statement)) & made_before) and not (
                    set(written) & read_after):
                fetches.append(statement)
        return fetches

    def _written(self, statement) -> list[str]:
        names = []
        for node in collect(statement, (cst.Assign, cst.AnnAssign, cst.AugAssign, cst.For,
                                        cst.WithItem)):
            if isinstance(node, cst.Assign):
                names += [n for t in node.targets for n in bound_names(t.target)]
            elif isinstance(node, (cst.AnnAssign, cst.AugAssign)):
                names += bound_names(node.target)
            elif isinstance(node, cst.For):
                names += bound_names(node.target)
            elif node.asname is not None:
                names += bound_names(node.asname.name)
        return names

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
            if isinstance(parent, cst.WithItem):
                continue  # a context manager (``with ctx:``), not data
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

    def batch(self, region, models: list[str], excluded: set[str]) -> list[str]:
        first = region[0]
        container = self.enclosing(first, _LOOPS + (cst.FunctionDef,))
        for statement, target, _ in self.assignments():
            if self.marker(statement) == "batch" and self.before(statement, first):
                return bound_names(target)
        excluded = {e.split(".")[0] for e in excluded} | {"self", "cls"}
        used = [n for s in region for n in self.data_names(s)]
        bound = set(self._bound_before(container, first))
        batch = [n for n in dict.fromkeys(used) if n in bound and n not in excluded]
        scope = container
        while not batch and scope is not self.module:
            # a fixed batch made once before the loop, passed to the function holding it,
            # or read by a closure from the function around it
            scope = self.enclosing(scope, (cst.FunctionDef,))
            outer = set(self._bound_before(scope, first)) - self._constants(scope)
            batch = [n for n in dict.fromkeys(used) if n in outer and n not in excluded]
        if not batch:
            raise NotFound("batch", f"could not tell which variables hold the batch fed to "
                           f"`{models[0]}` at line {self.line(first)}; end the line that assigns "
                           "them with `# memadvisor: batch`")
        return batch

    def _constants(self, scope) -> set[str]:
        """Names bound in ``scope`` only to literal numbers, strings or booleans (settings
        such as nanoGPT's ``gradient_accumulation_steps = 1``, not data)."""
        literal = (cst.Integer, cst.Float, cst.SimpleString, cst.ConcatenatedString)
        kinds: dict[str, bool] = {}
        for statement, target, value in self.assignments():
            if not self._inside(statement, scope):
                continue
            constant = isinstance(value, literal) or (
                isinstance(value, cst.Name) and value.value in ("True", "False", "None"))
            for name in bound_names(target):
                kinds[name] = kinds.get(name, True) and constant
        return {name for name, constant in kinds.items() if constant}

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

    def _find_iteration(self, found) -> None:
        """Several backward calls per iteration (a GAN): the batch is still sliced per rank
        once per iteration, at its source: the for loop's target, around the loop body up to
        the last backward (one part per rank: the body runs once, steps included)."""
        statements = [self.statement_of(b.expr) for b in found.backwards]
        loops = {self.enclosing(s, _LOOPS + _SCOPES) for s in statements}
        loop = loops.pop() if len(loops) == 1 else None
        if not isinstance(loop, cst.For) or not isinstance(loop.body, cst.IndentedBlock):
            raise NotFound("forward", "they are not all in one `for` loop over the batches")
        node = max(statements, key=self.order.get)
        while self.parents[node] is not loop.body:
            node = self.parents[node]
        body = list(loop.body.body)
        region = body[: body.index(node) + 1]
        for statement in region:
            for jump in collect(statement, (cst.Break, cst.Continue)):
                if self.enclosing(jump, _LOOPS) is loop:
                    raise NotFound("forward", f"line {self.line(jump)}: `break`/`continue` "
                                   "before the last backward would act on the per-rank loop")
        used = [n for s in region for n in self.data_names(s)]
        batch = [n for n in dict.fromkeys(used) if n in bound_names(loop.target)]
        if not batch:
            raise NotFound("batch", f"the loop at line {self.line(loop)} does not hand out the "
                           "batch (its target is not read as data before the last backward)")
        found.block, found.region, found.batch = loop.body, region, batch
        found.lines["forward"] = self.line(region[0])

    def _find_region(self, found) -> None:
        """The forward..backward region, its batch, and the names its parts get."""
        models = [p.model for p in found.pairs]
        backward_statement = self.statement_of(found.backwards[0].expr)
        found.block, found.region = self.forward_region(backward_statement, models)
        owners = {p.model for p in found.pairs} | {p.optimizer for p in found.pairs}
        found.batch = self.batch(found.region, models, owners | self.scalers())
        found.hoisted = self.hoistable(found.region, owners)
        found.after = self.next_batch_fetches(found.region, found.batch)
        if found.after:  # what only the fetch reads (a step counter) is not the batch
            kept = [s for s in found.region if s not in found.after]
            found.batch = self.batch(kept, models, owners | self.scalers())
        found.lines["forward"] = self.line(found.region[0])
        container = self.enclosing(found.region[0], _LOOPS + (cst.FunctionDef,))
        fresh = set(self._bound_before(container, found.region[0]))
        if isinstance(container, cst.FunctionDef):
            # names a function binds itself, anywhere in it, are its own (locals)
            fresh |= {n for s in collect(container.body, cst.CSTNode)
                      if isinstance(s, cst.SimpleStatementLine) for n in self._written(s)}
        taken = {n.value for n in self.nodes(cst.Name)}
        for name in found.batch:
            if name not in fresh:
                new = f"{name}_part"
                while new in taken:
                    new += "_"
                found.renames[name] = new
        for statement in found.region:
            if statement in found.after:
                continue
            rebound = set(self._written(statement)) & set(found.renames)
            if rebound:
                name = sorted(rebound)[0]
                raise NotFound("batch", f"line {self.line(statement)}: `{name}` (the batch) is "
                               "assigned again between the forward and the backward; its "
                               "micro-batches are named apart, so the next step would read "
                               "the same batch again")
