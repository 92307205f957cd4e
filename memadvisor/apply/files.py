"""Where the rewritten script goes, and how it gets there without harming the original.

Default: beside the script as ``<stem>_memadvisor.py``.  ``-o PATH`` chooses.  ``--in-place``
replaces the script after copying it to ``<name>.orig`` (kept from the first in-place
rewrite on, so it stays the true original).  A file that memadvisor did not write, or wrote
and someone edited since, is never overwritten: every file apply writes ends with a
signature line holding the SHA-256 of what is above it, and only a file whose content
still matches its signature counts as apply's own.  Writes go to a temporary file that is
then renamed over the target.
"""
from __future__ import annotations

import hashlib
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
        backup = script.with_name(script.name + ".orig")
        if backup.exists() and authorship(script) == "foreign":
            # the .orig is not a backup of this script (apply never rewrote it): keeping it
            # would leave the script with no copy of what it is now
            raise UserError(f"--in-place would back {script.name} up as {backup.name}, which "
                            "exists and is not a copy apply made: move it away first")
        return Destination(script, backup)
    path = output if output is not None else default_output(script)
    if path.resolve() == script.resolve():
        raise UserError(f"-o {path} is the script itself: use --in-place to rewrite it "
                        "(a backup is kept)")
    if path.is_dir():
        path = path / default_output(script).name
    if path.exists():
        who = authorship(path)
        if who == "edited":
            raise UserError(f"{path} was written by memadvisor apply and edited since: it is "
                            "not overwritten; choose another path with -o (or delete it)")
        if who == "foreign":
            raise UserError(f"{path} exists and was not written by memadvisor apply: "
                            "choose another path with -o")
    return Destination(path)


SIGNATURE = "# written by memadvisor apply; sha256 of the lines above: "


def signed(code: str) -> str:
    """``code`` (any earlier signature dropped) with its signature line appended."""
    body = unsigned(code)
    if body and not body.endswith("\n"):
        body += "\n"
    return f"{body}{SIGNATURE}{hashlib.sha256(body.encode()).hexdigest()}\n"


def unsigned(code: str) -> str:
    lines = code.splitlines(keepends=True)
    if lines and lines[-1].startswith(SIGNATURE):
        return "".join(lines[:-1])
    return code


def authorship(path: Path) -> str:
    """'memadvisor' (apply wrote it and nobody changed it since), 'edited' (apply wrote it,
    or it calls apply's runtime, but its content no longer matches a signature) or
    'foreign'."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "foreign"
    lines = text.splitlines(keepends=True)
    if lines and lines[-1].startswith(SIGNATURE):
        body = "".join(lines[:-1])
        digest = lines[-1][len(SIGNATURE):].strip()
        return "memadvisor" if hashlib.sha256(body.encode()).hexdigest() == digest else "edited"
    return "edited" if f"import {RUNTIME_MODULE}" in text else "foreign"


def written_by_memadvisor(path: Path) -> bool:
    return authorship(path) == "memadvisor"


def write(destination: Destination, script: Path, code: str) -> None:
    """Write the rewritten script (and the backup ``--in-place`` keeps) atomically; a
    filesystem that refuses (read-only, full) is one line, and nothing is left half done."""
    from ..output_files import describe_write_error
    try:
        _write(destination, script, code)
    except OSError as exc:
        where = exc.filename or destination.path
        raise UserError(describe_write_error(where, exc)) from None


def _write(destination: Destination, script: Path, code: str) -> None:
    if destination.backup is not None and not destination.backup.exists():
        shutil.copy2(script, destination.backup)
    folder = destination.path.parent
    folder.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=".memadvisor-", suffix=".py", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(signed(code))
        if destination.path.exists():
            shutil.copymode(destination.path, temporary)
        elif script.exists():
            shutil.copymode(script, temporary)
        os.replace(temporary, destination.path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
