"""The script a trace recorded, and copies of it rewritten for a plan by ``apply``.

A verification runs the user's script as ``memadvisor apply`` would run it: the same
rewrite (``apply.rewrite.rewrite_source``), written beside the original so its own imports,
``__file__`` and relative paths resolve as they did, under a hidden name that is removed
afterwards, and started in the folder the profile ran in with the recorded arguments.
"""
from __future__ import annotations

import contextlib
import difflib
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from ..plan import Plan


@dataclass(frozen=True)
class RecordedScript:
    path: Path  #: the script, absolute
    args: list[str]  #: its own arguments, as profiled
    cwd: Path  #: the folder the profile ran in
    source: str


def recorded_script(meta, trace_path: str | os.PathLike = "trace") -> RecordedScript:
    """The script ``meta`` recorded, or one line saying why it cannot be run again."""
    script, problem = locate_script(meta, trace_path)
    if script is not None:
        return script
    if not meta.script:
        raise UserError(f"{trace_path}: {problem}: --verify needs a trace written by "
                        "`memadvisor profile`")
    if problem.startswith("cannot read"):
        raise UserError(problem)
    where = problem.removeprefix("the profiled script ")
    raise UserError(f"--verify runs the profiled script again, but {where}")


def locate_script(meta, trace_path: str | os.PathLike = "trace"
                  ) -> tuple[RecordedScript | None, str | None]:
    """(the script ``meta`` recorded, None), or (None, why it cannot be run again: one
    clause, e.g. 'the profiled script /x/train.py (recorded in run.trace) is not there any
    more')."""
    if not meta.script:
        return None, "the trace names no script (imported from a snapshot?)"
    script = Path(meta.script)
    cwd = Path(meta.cwd) if meta.cwd else script.parent
    if not script.is_absolute():
        script = cwd / script
    if not script.is_file():
        return None, (f"the profiled script {script} (recorded in {trace_path}) is not there "
                      f"any more")
    if not cwd.is_dir():
        cwd = script.parent
    try:
        source = script.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return None, f"cannot read {script}: {getattr(exc, 'strerror', None) or exc}"
    return RecordedScript(path=script, args=list(meta.argv[1:]), cwd=cwd, source=source), None


def rewritten(script: RecordedScript, plan: Plan):
    """``apply``'s rewrite of the script for ``plan``: (code, None), or (None, why apply
    refuses it) -- the reason in apply's own words, its first line."""
    from ..apply.rewrite import rewrite_source
    try:
        return rewrite_source(script.source, plan, str(script.path)).code, None
    except UserError as exc:
        return None, " ".join(str(exc).split("\n", 1)[0].split())


def loop_moves_zero_grad(meta) -> bool | None:
    """Whether ``apply``'s loop rewrite of the recorded script moves a ``zero_grad`` in
    front of its forward (``apply.rewrite.moves_zero_grad``); None where the script is not
    there to ask (the simulator then goes by the trace alone)."""
    from ..apply.rewrite import moves_zero_grad
    try:
        script = recorded_script(meta)
        return moves_zero_grad(script.source, str(script.path))
    except UserError:
        return None


def baseline_as_applied(trace):
    """The simulator's baseline of ``trace`` with the loop as ``apply`` rewrites it: the
    one place the prediction asks apply, its ground truth, what the rewrite does."""
    from ..simulate import prepare
    base = prepare(trace)
    # apply (libcst, torch) is asked only where the trace has a zero_grad to move
    if base.rewritten is not base.timeline and loop_moves_zero_grad(trace.meta) is False:
        base.rewritten = base.timeline
    return base


def apply_refusals(script: RecordedScript, plans, device_type: str | None = None
                   ) -> dict[str, str]:
    """Plan (compact text) -> why ``apply`` cannot rewrite the script for it, for the
    plans it refuses (the rewrite only: nothing runs).  ``device_type='cpu'``: also the
    plans the rewritten script would stop at its start on a machine without a GPU (a
    framework's FSDP)."""
    from ..apply.frameworks.expectations import cpu_target_refusal
    refused = {}
    for plan in plans:
        code, why = rewritten(script, plan)
        if not why and device_type == "cpu":
            why = cpu_target_refusal(code)
        if why:
            refused[plan.to_compact()] = why
    return refused


@contextlib.contextmanager
def applied_copy(script: RecordedScript, code: str):
    """The rewritten script, written beside the original under a hidden unique name
    (removed on the way out); a temporary folder where the script's folder is read-only."""
    folder = script.path.parent
    prefix = f".{script.path.stem}_memadvisor_verify_"
    try:
        fd, name = tempfile.mkstemp(prefix=prefix, suffix=".py", dir=folder)
    except OSError:
        fd, name = tempfile.mkstemp(prefix=prefix, suffix=".py")
    path = Path(name)
    try:
        from ..apply.files import signed
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(signed(code))  # apply's own, so `apply -o` may write it again
        yield path
    finally:
        with contextlib.suppress(OSError):
            path.unlink()


def in_user_terms(text: str, copy: Path, script: RecordedScript, code: str) -> str:
    """``text`` naming the user's script and its line where it names the hidden copy: a
    line the rewrite kept maps to the original's; one it added is called so."""
    lines = _line_map(script.source, code)

    def replace(match):
        line = int(match.group(1))
        if line in lines:
            return f"{script.path}:{lines[line]}"
        return f"{script.path} (line {line} of the rewritten script)"

    text = re.sub(rf"(?:{re.escape(str(copy))}|{re.escape(copy.name)}):(\d+)", replace,
                  str(text))
    return text.replace(str(copy), str(script.path)).replace(copy.name, script.path.name)


def _line_map(original: str, code: str) -> dict[int, int]:
    """Rewritten line -> original line (1-based) for the lines the rewrite left as they
    were (re-indented ones included: the micro-batch loop indents the forward)."""
    before = [line.strip() for line in original.splitlines()]
    after = [line.strip() for line in code.splitlines()]
    mapping = {}
    matcher = difflib.SequenceMatcher(None, after, before, autojunk=False)
    for block in matcher.get_matching_blocks():
        for offset in range(block.size):
            mapping[block.a + offset + 1] = block.b + offset + 1
    return mapping
