"""Where the rewritten script goes, and how it gets there without harming the original.

Default: beside the script as ``<stem>_memadvisor.py``.  ``-o PATH`` chooses.  ``--in-place``
replaces the script after copying it to ``<name>.orig`` (kept from the first in-place
rewrite on, so it stays the true original).  A file that memadvisor did not write is
never overwritten.  Writes go to a temporary file that is then renamed over the target.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from .rewrite import RUNTIME_MODULE


@dataclass
class Destination:
    path: Path
    backup: Path | None = None  #: --in-place: where the original is kept


def default_output(script: Path) -> Path:
    return script.with_name(f"{script.stem}_memadvisor{script.suffix or '.py'}")


def choose_destination(script: Path, output: Path | None, in_place: bool) -> Destination:
    if in_place and output is not None:
        raise UserError("use either -o/--output or --in-place, not both")
    if in_place:
        return Destination(script, script.with_name(script.name + ".orig"))
    path = output if output is not None else default_output(script)
    if path.resolve() == script.resolve():
        raise UserError(f"-o {path} is the script itself: use --in-place to rewrite it "
                        "(a backup is kept)")
    if path.is_dir():
        path = path / default_output(script).name
    if path.exists() and not written_by_memadvisor(path):
        raise UserError(f"{path} exists and was not written by memadvisor apply: "
                        "choose another path with -o")
    return Destination(path)


def written_by_memadvisor(path: Path) -> bool:
    try:
        return f"import {RUNTIME_MODULE}" in path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False


def write(destination: Destination, script: Path, code: str) -> None:
    if destination.backup is not None and not destination.backup.exists():
        shutil.copy2(script, destination.backup)
    folder = destination.path.parent
    folder.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=".memadvisor-", suffix=".py", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(code)
        if destination.path.exists():
            shutil.copymode(destination.path, temporary)
        elif script.exists():
            shutil.copymode(script, temporary)
        os.replace(temporary, destination.path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
