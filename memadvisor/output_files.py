"""Writing a user's output file without ever losing anything.

Three rules every writer of traces, reports and snapshots follows (one place, so they
cannot drift):

- **Checked before the work**: ``check_output`` names an output that cannot be written (a
  directory, a path under a file, no permission, a name too long) in one line before a long
  run starts, not after it; the path is made absolute then, so a script that ``chdir``\\s
  cannot move it.
- **Atomic for regular files**: the bytes go to a temporary file beside the target, then
  ``os.replace``; a crash mid-write leaves the old file, never half a new one.
- **Never replace what is not a regular file**: a symlink is written through (its target
  is replaced, the link stays), a device node or FIFO (``-o /dev/null``, ``-o /dev/stdout``)
  is written into directly; ``os.replace`` onto them would swap a device for a plain file.
"""
from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path
from typing import Callable

from .errors import UserError


def check_output(path: str | os.PathLike, what: str = "output") -> Path:
    """The absolute path to write ``path`` to, after checking it can be written."""
    raw = Path(path).expanduser()
    if not str(raw) or str(path).strip() == "":
        raise UserError(f"{what}: an empty path")
    absolute = Path(os.path.abspath(raw))
    target = Path(os.path.realpath(absolute))  # through symlinks: what will really change
    try:
        return _checked(path, absolute, target, what)
    except OSError as exc:  # a name the filesystem cannot even look up
        raise UserError(describe_write_error(path, exc)) from None


def _checked(path, absolute: Path, target: Path, what: str) -> Path:
    if len(target.name.encode()) > _name_max(_first_existing_parent(target.parent)):
        raise UserError(f"{path}: the file name is too long for this filesystem")
    if target.is_dir():
        raise UserError(f"{path}: is a directory; name the {what} file to write")
    if target.exists() and not target.is_file():
        if not os.access(target, os.W_OK):
            raise UserError(f"{path}: cannot write to it (permission denied)")
        return absolute  # a device node or FIFO: written into directly
    folder = _first_existing_parent(target.parent)
    if not folder.is_dir():
        raise UserError(f"{path}: {folder} is not a directory")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(f"{path}: cannot write in {folder} (permission denied or read-only)")
    if target.exists() and not os.access(target, os.W_OK) and not os.access(folder, os.W_OK):
        raise UserError(f"{path}: cannot replace it (permission denied)")
    return absolute


def write_output(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Call ``write(p)`` to produce the file's bytes at a path ``p`` and put them at
    ``path`` by the rules above.  Returns ``path``."""
    path = Path(path)
    target = Path(os.path.realpath(path))
    if target.exists() and not target.is_file() and not target.is_dir():
        write(target)  # a device node or FIFO: into it, never replaced
        return path
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name[:40]}.", suffix=".tmp",
                                    dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        if target.exists():  # keep the permissions the user gave the file
            os.chmod(tmp, stat.S_IMODE(target.stat().st_mode))
        else:
            os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _first_existing_parent(folder: Path) -> Path:
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder


def _name_max(folder: Path) -> int:
    try:
        return os.statvfs(folder).f_namemax
    except (OSError, AttributeError):
        return 255


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def describe_write_error(path, exc: OSError) -> str:
    """One line for a write that failed late (disk full, filesystem gone read-only)."""
    reason = {errno.ENOSPC: "no space left on the device", errno.EROFS: "read-only filesystem",
              errno.EACCES: "permission denied", errno.ENAMETOOLONG: "the name is too long"
              }.get(exc.errno, exc.strerror or str(exc))
    return f"{path}: could not write ({reason})"
