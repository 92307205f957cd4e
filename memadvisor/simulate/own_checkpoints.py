"""Modules a script checkpoints itself (``torch.utils.checkpoint`` in its own code, HF's
``gradient_checkpointing_enable()``), read from its trace.

apply leaves such a module as the script runs it (``apply/checkpointing.py``: wrapping it
again inside the script's checkpoint would recompute it twice and save nothing), so a
checkpoint plan predicts nothing for it either: no saving, no second recompute.  The
trace shows it because a module's recompute records the source lines of its forward
again, in the backward, where a backward op carries the line that called ``backward()``.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from ..trace import schema
from ..trace.analysis import step_slice


#: share of a module's forward allocations (by source line) run again in the backward
#: that marks it as checkpointed by the script (non-reentrant checkpoint may stop its
#: recompute early, after the last saved tensor)
RERUN_SHARE = 0.5
#: containers that are never called themselves: named by their children
_UNCALLED = ("ModuleList", "ModuleDict")


@dataclass(frozen=True)
class ScriptCheckpointed:
    """What the script checkpoints itself (``script_checkpointed``)."""
    modules: frozenset  #: every module whose whole forward runs again in the backward
    shown: dict  #: the outermost ones -> where their forward is ('file:first-last')

    def covers(self, region: str) -> bool:
        """Whether ``region`` (or a module around it) is one the script checkpoints."""
        path = region
        while True:
            if path in self.modules:
                return True
            if not path:
                return False
            path = path.rpartition(".")[0]

    def warning(self, module_types: dict[str, str]) -> str:
        paths = list(self.shown)
        names = ", ".join(p or "<model>" for p in paths[:4]) + (
            f", ... ({len(paths)})" if len(paths) > 4 else "")
        kinds = sorted({module_types.get(p, "") for p in paths} - {""})
        where = sorted(set(self.shown.values()))
        return (f"the script checkpoints {names}"
                f"{' (' + ', '.join(kinds) + ')' if kinds else ''} itself: their forward "
                f"({', '.join(where[:2])}) runs again in the recorded backward; checkpoint "
                "plans leave them as they are (nothing more to save, no second recompute)")


def script_checkpointed(events, step: int | None = None,
                        module_types: dict[str, str] | None = None) -> ScriptCheckpointed:
    """Modules the script checkpoints itself (``torch.utils.checkpoint`` in its own code,
    HF's ``gradient_checkpointing_enable()``), read from the trace: the source lines of
    their forward are recorded again in the backward (the recompute), where a backward op
    carries the line that called ``backward()``.  A module counts where its own forward
    allocations and each child's are run again (``RERUN_SHARE``), so the model around
    checkpointed blocks does not.  Lines that call ``backward()`` are left out (a model
    called on the ``.backward()`` line), and so are allocations outside any op (a
    checkpoint's saved RNG state)."""
    module_types = module_types or {}
    window = events.iloc[step_slice(events, step)]
    window = window[(window["action"].astype(str) == "alloc")
                    & (window["op"].astype(str) != "")]
    if not len(window):
        return ScriptCheckpointed(frozenset(), {})
    phase = window["phase"].astype(str).to_numpy()
    op = window["op"].astype(str).to_numpy().astype(str)
    module = window["module"].astype(str).to_numpy().astype(str)
    files = window["source_file"].astype(str).to_numpy().astype(str)
    line = window["source_line"].to_numpy()
    key = np.char.add(np.char.add(files, ":"), line.astype(str))
    backward = phase == schema.BACKWARD
    genuine = backward & (np.char.find(op, "backward") >= 0)
    # the lines that call backward(): a backward op's, one outside any module (the loss's
    # seed gradient), each backward pass's first allocation
    starts = backward & ~np.append(False, backward[:-1])
    call_lines = key[genuine | (backward & (module == "")) | starts]
    in_forward = (phase == schema.FORWARD) & ~np.isin(key, call_lines)
    rerun = backward & ~genuine
    if not in_forward.any() or not rerun.any():
        return ScriptCheckpointed(frozenset(), {})
    pairs = set(zip(module[in_forward].tolist(), key[in_forward].tolist()))
    rerun[rerun] = [(m, k) in pairs for m, k in zip(module[rerun], key[rerun])]
    made = Counter(module[in_forward].tolist())
    again = Counter(module[rerun].tolist())
    if not again:
        return ScriptCheckpointed(frozenset(), {})
    # whether each module's first forward allocation is recorded again: a recompute
    # starts where the call starts (and may stop early, after the last saved tensor)
    firsts, at = np.unique(module[in_forward], return_index=True)
    forward_keys = key[in_forward]
    recorded_again = set(zip(module[rerun].tolist(), key[rerun].tolist()))
    first_of = {m: (int(i), (m, forward_keys[i]) in recorded_again)
                for m, i in zip(firsts.tolist(), at.tolist())}
    paths = set(made)
    for path in list(made):  # every ancestor of a module that allocates
        while path:
            path = path.rpartition(".")[0]
            paths.add(path)
    children: dict[str, list[str]] = {}
    for path in paths:
        if path:
            children.setdefault(path.rpartition(".")[0], []).append(path)
    first: dict[str, tuple[int, bool]] = {}
    for path in sorted(paths, key=lambda p: -p.count(".")):
        candidates = [first_of[path]] if path in first_of else []
        candidates += [first[c] for c in children.get(path, ()) if c in first]
        if candidates:
            first[path] = min(candidates)
    memo: dict[str, bool] = {}

    def is_rerun(path: str) -> bool:
        """Its first allocation is recorded again, and so are most of its parts (its own
        allocations, each child that allocates)."""
        if path not in memo:
            parts = [again.get(path, 0) >= RERUN_SHARE * made[path]] if made.get(path) else []
            parts += [is_rerun(c) for c in children.get(path, ()) if c in first]
            memo[path] = (path in first and first[path][1]
                          and sum(parts) >= RERUN_SHARE * len(parts))
        return memo[path]

    found = frozenset(p for p in paths if is_rerun(p))
    outermost = [p for p in sorted(found) if not any(
        q != p and (q == "" or p.startswith(q + ".")) for q in found)]
    shown: dict[str, str] = {}
    while outermost:
        path = outermost.pop(0)
        if module_types.get(path) in _UNCALLED and children.get(path):
            outermost[:0] = sorted(children[path], key=_natural)
            continue
        inside = in_forward & ((module == path) | np.char.startswith(module, path + "."))
        source = files[inside][0] if inside.any() else "?"
        lines = line[inside][files[inside] == source].astype(int)
        shown[path] = f"{source}:{lines.min()}-{lines.max()}" if len(lines) else source
    return ScriptCheckpointed(found, shown)


def _natural(path: str) -> tuple:
    return tuple(int(p) if p.isdigit() else -1 for p in path.split(".")), path
