"""The training calls of a script: optimizers and the models they train, backward calls,
optimizer steps (bare, with a closure, through a GradScaler) and gradient clipping.

A mixin of ``ScriptFinder`` (find.py): it uses the finder's index of the syntax tree.

==============  ===========================================================================
optimizer       ``NAME = torch.optim.<Class>(...)``, or ``NAME = <any call>(...)`` when NAME
                is stepped (``NAME.step()``, ``NAME.step(closure)``, ``scaler.step(NAME)``):
                an optimizer made by a method (nanoGPT's ``configure_optimizers``) is checked
                at run time by ``prepare``.  Every stepped optimizer is one (model, optimizer)
                pair (a GAN has two).
model           ``X`` of ``X.parameters()``/``X.named_parameters()`` in the optimizer's
                arguments, or in the assignments that built the names they read; else the
                one object passed to the call (or owning the method) that the script calls
                as a module (``build_groups(model, ...)``, ``model.configure_optimizers()``)
backward        every ``<loss>.backward()`` and ``<scaler>.scale(<loss>).backward()``
==============  ===========================================================================
"""
from __future__ import annotations

import libcst as cst

from .syntax import (
    LOOPS, OPTIM_CALL, SCOPES, TORCH_OPTIMIZERS, NotFound, collect, dotted, same_object,
)

#: receivers of ``.backward(...)`` that are not a loss
_NOT_LOSSES = {"torch.autograd", "autograd"}
#: how far back the model search follows the names an optimizer's arguments read
_SOURCE_DEPTH = 3


def _is_scheduler(func: str) -> bool:
    return "sched" in func.lower()


class TrainingCalls:
    """Mixin: needs ``module``, ``parents``, ``line``, ``nodes``, ``before``, ``marker``,
    ``statement_of``, ``enclosing``, ``assignments``, ``expression_calls``."""

    # --- optimizers -------------------------------------------------------------------
    def scalers(self) -> set[str]:
        """Names of GradScalers: assigned from ``*GradScaler(...)`` or used as
        ``S.scale(loss).backward()``."""
        names = {self.module.code_for_node(t).strip() for _, t, v in self.assignments()
                 if isinstance(v, cst.Call) and (dotted(v.func) or "").endswith("GradScaler")}
        for backward in self.backwards(required=False):
            if backward.scaler is not None:
                names.add(self.module.code_for_node(backward.scaler).strip())
        return names

    def _stepped(self) -> set[str]:
        """What the script steps like an optimizer: ``X.step()``, ``X.step(<function>)``,
        ``<scaler>.step(X)`` (not ``env.step(action)``)."""
        functions = {f.name.value for f in self.nodes(cst.FunctionDef)}
        scalers = self.scalers()
        found = set()
        for expr in self.expression_calls("step"):
            call = expr.value
            receiver = dotted(call.func.value)
            if not call.args or (len(call.args) == 1 and (
                    isinstance(call.args[0].value, cst.Lambda)
                    or dotted(call.args[0].value) in functions)):
                found.add(receiver)
            if call.args and receiver in scalers:
                found.add(dotted(call.args[0].value))
        return {s for s in found if s}

    def optimizers(self) -> list[tuple[cst.CSTNode, str, cst.CSTNode, bool]]:
        """(statement prepare follows, name, value, made by an opaque call) per optimizer."""
        marked, known, opaque = [], [], []
        stepped = self._stepped()
        for statement, target, value in self.assignments():
            text = self.module.code_for_node(target).strip()
            if self.marker(statement) == "optimizer":
                marked.append((statement, text, value, True))
            elif isinstance(value, cst.Call):
                func = dotted(value.func) or ""
                if _is_scheduler(func) or func.endswith("GradScaler"):
                    continue
                if OPTIM_CALL.search(func) or func in TORCH_OPTIMIZERS:
                    known.append((statement, text, value, False))
                elif any(same_object(s, text) for s in stepped):
                    opaque.append((statement, text, value, True))
        # an object made from an optimizer (a warmup or scheduler wrapper) is not another one
        known_names = {text for _, text, _, _ in known}
        opaque = [c for c in opaque if not any(
            same_object(dotted(n), k) for n in collect(c[2], (cst.Name, cst.Attribute))
            for k in known_names)]
        chosen = marked or known + opaque
        if not chosen:
            manual = any(isinstance(s, cst.AugAssign) and isinstance(s.target, cst.Name)
                         for s in self.nodes(cst.AugAssign))
            hint = (" (the script seems to update parameters by hand; memadvisor needs a "
                    "torch.optim optimizer to shard, swap or offload)" if manual else "")
            raise NotFound("optimizer", "no `NAME = torch.optim.<Class>(...)` found" + hint +
                           "; if the optimizer is made elsewhere, end the line that assigns it "
                           "with `# memadvisor: optimizer`")
        by_name: dict[str, list] = {}
        for candidate in chosen:
            by_name.setdefault(candidate[1], []).append(candidate)
        result = []
        for text, same in by_name.items():
            if len(same) == 1:
                result.append(same[0])
                continue
            # one optimizer chosen by a flag (if/elif/else): prepare after the whole choice
            common = self._common_statement([c[0] for c in same])
            if common is None:
                lines = ", ".join(str(self.line(c[0])) for c in same)
                raise NotFound("optimizer", f"`{text}` is assigned {len(same)} times (lines "
                               f"{lines}); mark the one to use with `# memadvisor: optimizer`")
            result.append((common, text, same[0][2], any(c[3] for c in same)))
        if len(result) > 1:
            with_step = [c for c in result if any(same_object(s, c[1]) for s in stepped)]
            if not with_step:
                lines = ", ".join(str(self.line(c[0])) for c in result)
                raise NotFound("optimizer", f"{len(result)} optimizers (lines {lines}) and none "
                               "is stepped: mark the one to use with `# memadvisor: optimizer`")
            result = with_step
        return result

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
        shared = [n for n in shared if not isinstance(n, (*SCOPES, *LOOPS))]
        return shared[0] if shared else None

    # --- models -----------------------------------------------------------------------
    def model(self, optimizer_statement, optimizer_value, use_marker: bool = True) -> str:
        if use_marker:
            for statement, target, _ in self.assignments():
                if self.marker(statement) == "model":
                    return self.module.code_for_node(target).strip()
        owners = self.parameter_owners(optimizer_value)
        if not owners:
            owners = self._owners_of_sources(optimizer_statement, optimizer_value)
        if not owners:
            owners = self._modules_handed_over(optimizer_value)
        if len(owners) != 1:
            found = f" (found {', '.join(owners)})" if owners else ""
            raise NotFound("model", "could not tell which model the optimizer at line "
                           f"{self.line(optimizer_statement)} trains: expected "
                           f"`MODEL.parameters()` in its arguments{found}; end the line that "
                           "assigns the model with `# memadvisor: model`")
        return owners[0]

    def parameter_owners(self, node) -> list[str]:
        owners = []
        for call in collect(node, cst.Call):
            if (isinstance(call.func, cst.Attribute)
                    and call.func.attr.value in ("parameters", "named_parameters")):
                owner = dotted(call.func.value)
                if owner:
                    owners.append(owner)
        return list(dict.fromkeys(owners))

    def _owners_of_sources(self, statement, value) -> list[str]:
        """Parameter owners in the assignments (and for-loops) that built the names the
        optimizer's arguments read, followed back a few steps (decay/no-decay lists)."""
        scope = self.enclosing(statement, SCOPES)
        names = {n.value for n in collect(value, cst.Name)}
        owners: list[str] = []
        seen: set[str] = set()
        for _ in range(_SOURCE_DEPTH):
            names -= seen
            if not names:
                break
            seen |= names
            sources = []
            for other, target, assigned in self.assignments():
                if (self.before(other, statement) and self.enclosing(other, SCOPES) is scope
                        and names & {n.value for n in collect(target, cst.Name)}):
                    sources.append(assigned)
            for loop in collect(scope, cst.For):
                if self.before(loop, statement) and names & {
                        n.value for n in collect(loop.target, cst.Name)}:
                    sources.append(loop.iter)
            # ``groups.append({...})`` / ``decay.append(p)`` build lists by mutation
            for call in self.nodes(cst.Call):
                if (isinstance(call.func, cst.Attribute)
                        and call.func.attr.value in ("append", "extend")
                        and dotted(call.func.value) in names and self.before(call, statement)
                        and self.enclosing(call, SCOPES) is scope):
                    sources.append(call)
            for source in sources:
                owners += self.parameter_owners(source)
            names = {n.value for source in sources for n in collect(source, cst.Name)}
        return list(dict.fromkeys(owners))

    def _modules_handed_over(self, value) -> list[str]:
        """Objects passed to the optimizer-making call, or owning the method it calls, that
        the script also calls like a module (``model(x)``)."""
        called = {dotted(c.func) for c in self.nodes(cst.Call)}
        handed = []
        for call in collect(value, cst.Call):
            if isinstance(call.func, cst.Attribute):
                handed.append(dotted(call.func.value))
            handed += [dotted(arg.value) for arg in call.args]
        return list(dict.fromkeys(h for h in handed if h and h in called))

    # --- backward, step, clip ---------------------------------------------------------
    def backwards(self, required: bool = True) -> list:
        from .find import Backward
        found = []
        for expr in self.expression_calls("backward"):
            receiver = expr.value.func.value
            if dotted(receiver) in _NOT_LOSSES:
                continue
            if (isinstance(receiver, cst.Call) and isinstance(receiver.func, cst.Attribute)
                    and receiver.func.attr.value == "scale" and len(receiver.args) == 1):
                found.append(Backward(expr, receiver.args[0].value, receiver.func.value))
            else:
                found.append(Backward(expr, receiver))
        if not found and required:
            raise NotFound("backward", "no `<loss>.backward()` statement found")
        return found

    def steps(self, optimizer: str) -> list:
        """Every step of ``optimizer``: ``opt.step(...)`` or ``<scaler>.step(opt, ...)``."""
        from .find import Step
        schedulers = {self.module.code_for_node(t).strip()
                      for _, t, v in self.assignments()
                      if isinstance(v, cst.Call) and _is_scheduler(dotted(v.func) or "")}
        scalers = self.scalers()
        found = []
        for expr in self.expression_calls("step"):
            call = expr.value
            receiver = call.func.value
            if (same_object(dotted(receiver), optimizer)
                    and dotted(receiver) not in schedulers):
                found.append(Step(expr, receiver, list(call.args)))
            elif (call.args and dotted(receiver) in scalers
                  and same_object(dotted(call.args[0].value), optimizer)):
                found.append(Step(expr, call.args[0].value, list(call.args[1:]), receiver))
        if not found:
            raise NotFound("step", f"no `{optimizer}.step()` call found for the optimizer")
        return found

    def unscales(self, optimizers: list[str]) -> list:
        """``<scaler>.unscale_(<optimizer>)`` statements: they go through the runtime, which
        knows whether the plan's scaler or the script's scales the loss."""
        from .find import Step
        scalers = self.scalers()
        return [Step(e, e.value.args[0].value, [], e.value.func.value)
                for e in self.expression_calls("unscale_")
                if len(e.value.args) == 1 and dotted(e.value.func.value) in scalers
                and any(same_object(dotted(e.value.args[0].value), o) for o in optimizers)]

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

    # --- what the model is used for besides training ----------------------------------
    def model_methods(self, model: str, prepared_after) -> list[str]:
        """The model's own methods the script calls after ``prepare`` (``model.decode(z)``):
        ``prepare`` forwards them through its wrapper.  nn.Module's methods are not among
        them, nor calls before ``prepared_after`` outside functions (they see no wrapper)."""
        from torch import nn
        inherited = set(dir(nn.Module))
        names = []
        for call in self.nodes(cst.Call):
            if (self.before(call, prepared_after) or call in collect(prepared_after, cst.Call)) \
                    and self.enclosing(call, SCOPES) is self.module:
                continue
            if (isinstance(call.func, cst.Attribute) and call.func.attr.value not in inherited
                    and same_object(dotted(call.func.value), model)
                    and dotted(call.func.value) != "self"):
                names.append(call.func.attr.value)
        return list(dict.fromkeys(names))

    def shadow_copies(self, models: list[str]) -> list[str]:
        """Lines updating another copy from a trained model's parameters in step with them
        (``zip(ema.parameters(), model.parameters())``: EMA, target networks): sharded
        parameters (FSDP's DTensors) cannot be mixed with the copy's plain tensors."""
        found = []
        for call in self.nodes(cst.Call):
            if dotted(call.func) != "zip" or len(call.args) < 2:
                continue
            owners = [self.parameter_owners(arg.value) for arg in call.args]
            trained = [o for group in owners for o in group
                       if any(same_object(o, m) for m in models)]
            if trained and sum(bool(group) for group in owners) >= 2:
                found.append(f"line {self.line(call)}: `{self.module.code_for_node(call)}`")
        return found

    # --- prepare must run on the path that trains --------------------------------------
    def check_prepare_runs(self, statement, optimizer: str, steps: list) -> None:
        """Refuse an optimizer made under an ``if`` whose step sits in an ``if`` with another
        branch (that branch trains without it, e.g. by hand): ``prepare`` follows the
        optimizer, so on that path no knob of the plan would apply, and the run would still
        exit 0."""
        made_under = self._guards(statement)
        if not made_under:
            return
        for step in steps:
            step_statement = self.statement_of(step.expr)
            for guard, branch in self._guards(step_statement):
                other = guard.orelse if branch is guard.body else guard.body
                if other is None or self._steps_in(other, optimizer):
                    continue
                test = self.module.code_for_node(guard.test).strip()
                made = made_under[0][0]
                made_test = self.module.code_for_node(made.test).strip()
                raise NotFound("optimizer", (
                    f"line {self.line(step_statement)}: `{optimizer}` is stepped only when "
                    f"`{test}` (line {self.line(guard)}); the other branch (line "
                    f"{self.line(other)}) trains without it, and the optimizer is made only "
                    f"when `{made_test}` (line {self.line(made)}): mem.prepare would not run on "
                    "that path and no knob of the plan would apply; make the optimizer and its "
                    "step unconditional"))

    def _guards(self, node) -> list[tuple[cst.If, cst.CSTNode]]:
        """The ``if`` statements (innermost first, within the function) that ``node`` is in
        a branch of; a statement that *is* the if/else choice is not guarded by it."""
        found = []
        child = node
        while child is not self.module:
            parent = self.parents[child]
            if isinstance(parent, SCOPES):
                break
            if isinstance(parent, cst.If) and child is not parent.test:
                found.append((parent, child))
            child = parent
        return found

    def _steps_in(self, node, optimizer: str) -> bool:
        for call in collect(node, cst.Call):
            if isinstance(call.func, cst.Attribute) and call.func.attr.value == "step" and (
                    same_object(dotted(call.func.value), optimizer)
                    or (call.args and same_object(dotted(call.args[0].value), optimizer))):
                return True
        return False
