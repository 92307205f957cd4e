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

Besides: one ``prepare`` per (model, optimizer) pair (a GAN has two, no micro-batch loop when
a step has several backward calls); a script's GradScaler is handed over
(``mem.backward(loss, scaler=scaler)``, ``mem.step(optimizer, scaler=scaler)``,
``mem.unscale_(optimizer, scaler=scaler)``); ``optimizer.step(closure)`` becomes
``mem.step(optimizer, closure)``; the next batch fetched between forward and backward
(nanoGPT) runs after the micro-batch loop; ``methods=[...]`` on ``prepare`` names the model's
own methods the script calls after it (``model.decode``).

The structure does not depend on the plan (the plan is one string literal), so switching
plans changes one line, and a script rewritten before only gets its plan literal replaced.
A plan the script's shape cannot take (accumulation inside a closure, splitting a batch
read by several backward calls, an EMA copy of FSDP-sharded parameters) is refused here,
naming the knob and the line (``plan_refusal``), both when rewriting and when replacing the
plan literal.
"""
from __future__ import annotations

import difflib
import functools
from dataclasses import dataclass, field

import libcst as cst

from ..errors import UserError
from ..plan import Plan
from . import loss_expression, loss_function_edit
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


def moves_zero_grad(source: str, filename: str = "script.py") -> bool:
    """Whether the loop rewrite moves a ``zero_grad()`` from between the forward and the
    backward in front of the micro-batch loop (``_Editor``): only in a raw loop with one
    forward..backward region; framework scripts (their own loops, their own knobs) and
    several backward calls per iteration keep theirs.  RewriteError if unparsable."""
    module, framework = _parsed(source, filename)
    if framework is not None:
        return False
    try:
        found = ScriptFinder(module, filename).find()
    except ScriptNotUnderstood as exc:
        raise RewriteError(str(exc)) from None
    return bool(found.hoisted)


@functools.lru_cache(maxsize=8)
def _parsed(source: str, filename: str) -> tuple[cst.Module, str | None]:
    """The script's syntax tree and the framework it trains with (None: a raw loop).  The
    same for every plan: ``advise`` rewrites one script for each plan it checks, and
    parsing and framework detection were most of each rewrite's time.  libcst trees are
    immutable, so one can serve every rewrite.  RewriteError if unparsable."""
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
    return module, frameworks.detect(module, filename)


def rewrite_source(source: str, plan: Plan, filename: str = "script.py") -> Rewrite:
    module, framework = _parsed(source, filename)
    if framework is not None:
        from . import frameworks
        return frameworks.rewrite(module, source, plan, filename)
    finder = ScriptFinder(module, filename)
    scheduler = scheduler_refusal(finder, plan)
    if scheduler:
        raise RewriteError(f"cannot rewrite {filename} for plan {plan}: {scheduler} "
                           "(nothing was written or run)")
    existing = _existing_prepare(finder)
    if existing is not None:
        refusal = _rewritten_refusal(finder, plan)
        if refusal:
            raise RewriteError(f"cannot switch {filename} to plan {plan}: {refusal}; rewrite "
                               "the original script instead (nothing was written or run)")
        return _update_plan(module, source, plan, existing)
    try:
        found = finder.find()
    except ScriptNotUnderstood as exc:
        raise RewriteError(str(exc)) from None
    refusal = plan_refusal(plan, found.split_refusal, found.closure_steps, found.shadow_copies,
                           found.accum_refusal)
    crowded = finder.crowded_line(found) if plan.accum > 1 else None
    if crowded and not refusal:
        refusal = (f"accum={plan.accum}: {crowded}: the micro-batch loop would repeat that "
                   "line whole, stepping the optimizer per micro-batch; put each statement on "
                   "a line of its own")
    if refusal:
        raise RewriteError(f"cannot rewrite {filename} for plan {plan}: {refusal} "
                           "(nothing was written or run)")
    loss_function = None
    if plan.pp > 1:
        try:
            loss_function = loss_expression.analyse(finder, found, str(plan))
        except loss_expression.NotPipelinable as exc:
            raise RewriteError(f"cannot rewrite {filename} for plan {plan}: {exc} "
                               "(nothing was written or run)") from None
    alias = _free_alias(finder)
    new_module = finder.module.visit(
        _Editor(found, plan, alias, _import_anchor(finder.module), finder.parents,
                loss_function))
    lines = {k: f"line {v}" for k, v in found.lines.items()}
    if loss_function is not None:
        lines["loss"] = (f"line {finder.line(loss_function.statements[0])}, the pipeline's loss "
                         f"function `{loss_function.function_name}`")
    return Rewrite(source, new_module.code, plan, found={
        "model": found.model, "optimizer": found.optimizer, "batch": ", ".join(found.batch),
        **lines})


def plan_refusal(plan: Plan, split_refusal: str | None, closure_steps: list[str],
                 shadow_copies: list[str] = (), accum_refusal: str | None = None) -> str | None:
    """Why ``plan`` cannot run on this script's shape, naming the knob (None: it can)."""
    if plan.accum > 1 and accum_refusal:
        return f"accum={plan.accum}: {accum_refusal}"
    if plan.uses_fsdp and accum_refusal:
        return (f"shard={plan.shard}: {accum_refusal.split(' per iteration')[0]} per "
                "iteration: a model forwarded several times between its optimizer's steps "
                "(a GAN's discriminator) is not sharded by memadvisor, whose check of FSDP's "
                "memory signature assumes one forward..backward per step; use shard=ddp")
    if plan.uses_fsdp and shadow_copies:
        return (f"shard={plan.shard}: {shadow_copies[0]} updates another copy of the model "
                "from its parameters (an EMA or target network); FSDP shards those parameters "
                "into DTensors, which cannot be mixed with the copy's plain tensors")
    if plan.accum > 1 and closure_steps:
        return (f"accum={plan.accum}: {closure_steps[0]} evaluates the loss inside the closure, "
                "which the optimizer may call several times per step (LBFGS re-evaluates it "
                "in its line search); accumulation cannot split micro-batches inside it")
    if split_refusal and (plan.accum > 1 or plan.world > 1):
        knob = (f"accum={plan.accum}" if plan.accum > 1 else
                f"pp={plan.pp} (the pipeline cuts the batch into micro-batches)" if plan.pp > 1
                else f"shard={plan.shard},world={plan.world} (each rank takes a slice of the "
                     "batch)")
        return f"{knob}: the batch cannot be split: {split_refusal}"
    return None


# --- the edits ----------------------------------------------------------------------------
def _statement(code: str) -> cst.SimpleStatementLine:
    return cst.parse_statement(code)


class _Editor(cst.CSTTransformer):
    def __init__(self, found: Found, plan: Plan, alias: str, import_anchor, parents,
                 loss_function: loss_expression.LossFunction | None = None):
        self.found = found
        #: pp with a loss the script computes: those statements become the loss function
        self.loss_function = loss_function
        self.parents = parents
        self._in_region = 0
        self.alias = alias
        self.plan_literal = _string_literal(str(plan))
        self.import_anchor = import_anchor
        self.backwards = {id(b.expr): b for b in found.backwards}
        self.steps = {id(s.expr): s for s in (*found.steps, *found.unscales)}
        self.unscales = {id(s.expr) for s in found.unscales}
        self.prepares: dict[int, list] = {}
        for pair in found.pairs:
            self.prepares.setdefault(id(pair.insert_after), []).append(pair)
        self.clips = {id(c) for c in found.clips}
        after = {id(s) for s in found.after}
        self.region = {id(s) for s in found.region if id(s) not in after}
        self.region_start = id(found.region[0]) if found.region else None
        self.after = after
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
        backward = self.backwards.get(id(original))
        if backward is not None:
            # ``loss.backward(...)`` -> ``mem.backward(loss, ...)``; a script's GradScaler is
            # handed over, not applied here: the runtime knows if the plan brings its own
            call = updated.value
            receiver = call.func.value
            loss = receiver.args[0].value if backward.scaler is not None else receiver
            args = [cst.Arg(loss), *call.args]
            if backward.scaler is not None:
                args.append(_keyword("scaler", receiver.func.value))
            return updated.with_changes(value=cst.Call(
                func=self._runtime("backward"), args=_commas(args)))
        step = self.steps.get(id(original))
        if step is not None:
            call = updated.value
            if step.scaler is None:
                optimizer, rest = call.func.value, list(call.args)
            else:
                optimizer, rest = call.args[0].value, list(call.args[1:])
            args = [cst.Arg(optimizer), *rest]
            if step.scaler is not None:
                args.append(_keyword("scaler", call.func.value))
            name = "unscale_" if id(original) in self.unscales else "step"
            return updated.with_changes(value=cst.Call(
                func=self._runtime(name), args=_commas(args)))
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
            if id(old) == self.region_start:
                count = len(self.found.region)
                olds = [o for o, _ in pairs[index: index + count]]
                news = [n for _, n in pairs[index: index + count]]
                inside = [(o, n) for o, n in zip(olds, news) if id(o) not in self.after]
                body.extend(self._micro_batch_loop([n for _, n in inside], [o for o, _ in inside]))
                # the next batch is fetched once per step, after the micro-batches
                body.extend(n for o, n in zip(olds, news) if id(o) in self.after)
                index += count
                continue
            body.append(new)
            if old is self.import_anchor:
                body.append(_statement(f"import {RUNTIME_MODULE} as {self.alias}\n"))
            for pair in self.prepares.get(id(old), ()):
                body.append(self._prepare_statement(pair, len(self._indent_of(original))))
            index += 1
        if isinstance(original, cst.Module) and self.import_anchor is None:
            body.insert(0, _statement(f"import {RUNTIME_MODULE} as {self.alias}\n"))
        return body

    def _prepare_statement(self, pair, indent: int) -> cst.SimpleStatementLine:
        model, optimizer = pair.model, pair.optimizer
        methods = f", methods={pair.methods!r}" if pair.methods else ""
        call = f"{self.alias}.prepare({model}, {optimizer}, plan={self.plan_literal}{methods})"
        line = f"{model}, {optimizer} = {call}\n"
        if indent + len(line) > MAX_LINE:  # the way black would wrap it
            line = (f"{model}, {optimizer} = {self.alias}.prepare(\n"
                    f"    {model}, {optimizer}, plan={self.plan_literal}{methods}\n)\n")
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
        if self.loss_function is not None:
            inside = self._with_loss_function(inside, [o for o in old_statements
                                                       if id(o) not in self.hoisted])
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


    def _with_loss_function(self, inside: list, olds: list) -> list:
        """The loss statements replaced by the loss function and the model call through
        ``mem.with_loss`` (loss_expression.py finds them, loss_function_edit.py builds it)."""
        moved = [id(s) for s in self.loss_function.statements]
        positions = [i for i, old in enumerate(olds) if id(old) in moved]
        updated = [inside[i] for i in positions]
        built = loss_function_edit.pipeline_statements(self.loss_function, updated, self.alias)
        start = positions[0]
        return [*inside[:start], *built,
                *(s for i, s in enumerate(inside) if i > start and i not in positions)]


def _keyword(name: str, value) -> cst.Arg:
    return cst.Arg(value, keyword=cst.Name(name), equal=cst.AssignEqual(
        whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")))


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


#: LR schedulers that also cycle the optimizer's momentum (or Adam's beta1) unless told not to
_MOMENTUM_CYCLING = ("OneCycleLR", "CyclicLR")
#: swapped-in optimizers with no momentum to cycle: SGD's is 0 (cycling turns it on, adding
#: momentum buffers the plan did not predict), Adafactor has neither momentum nor betas
#: (the scheduler raises at construction)
_NO_MOMENTUM = {"sgd": "turns momentum on for the plain SGD the plan swaps in (a change of "
                       "training and a momentum buffer per parameter the plan did not predict)",
                "adafactor": "fails at construction with Adafactor, which has no momentum "
                             "or betas to cycle"}


def scheduler_refusal(finder: ScriptFinder, plan: Plan) -> str | None:
    """An optimizer swap the script's LR scheduler cannot run with, naming its line."""
    why = _NO_MOMENTUM.get(plan.optimizer)
    if why is None:
        return None
    for call in finder.nodes(cst.Call):
        name = dotted(call.func) or ""
        if not name.endswith(_MOMENTUM_CYCLING):
            continue
        cycling = next((a.value for a in call.args if a.keyword is not None
                        and a.keyword.value == "cycle_momentum"), None)
        if isinstance(cycling, cst.Name) and cycling.value == "False":
            continue
        return (f"optimizer={plan.optimizer}: line {finder.line(call)}: "
                f"`{name.rsplit('.', 1)[-1]}` cycles momentum (cycle_momentum is on), which "
                f"{why}; pass cycle_momentum=False there or keep the optimizer")
    return None


def _rewritten_refusal(finder: ScriptFinder, plan: Plan) -> str | None:
    """The shape refusals of ``plan_refusal`` read back from a script rewritten before: no
    micro-batch loop means the rewrite found no one region to split; a runtime step given
    more than the optimizer steps with a closure."""
    calls = [(dotted(c.func) or "", c) for c in finder.nodes(cst.Call)]
    splits = any(name.endswith(".micro_batches") for name, _ in calls)
    closures = [f"line {finder.line(c)}: `{finder.module.code_for_node(c)}`" for name, c in calls
                if name.endswith(".step") and len([a for a in c.args if a.keyword is None]) > 1]
    backwards = [c for name, c in calls if name.endswith(".backward") and name != "torch.autograd.backward"]
    several = (f"{len(backwards)} backward calls (lines "
               f"{', '.join(str(finder.line(c)) for c in backwards)}) per iteration"
               if len(backwards) > 1 else None)
    return plan_refusal(plan, None if splits else "it was rewritten without a micro-batch loop",
                        closures, finder.shadow_copies(_prepared_models(finder)), several)


def _prepared_models(finder: ScriptFinder) -> list[str]:
    return [dotted(c.args[0].value) or "" for c in finder.nodes(cst.Call)
            if (dotted(c.func) or "").endswith(".prepare") and c.args]


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
