"""Outputs never lose what the user had: symlinks written through, device nodes and FIFOs
written into (never replaced by a plain file), unwritable targets named before any work."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading

import pytest

from memadvisor.errors import UserError
from memadvisor.output_files import check_output, write_output
from memadvisor.report.synthetic import make_trace


def test_symlink_is_written_through(tmp_path):
    real = tmp_path / "real.trace"
    real.write_text("old")
    link = tmp_path / "link.trace"
    link.symlink_to(real)
    write_output(link, lambda where: where.write_text("new"))
    assert link.is_symlink() and real.read_text() == "new"


def test_fifo_is_written_into_not_replaced(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.append(open(fifo, "rb").read()))
    reader.start()
    write_output(fifo, lambda where: where.write_bytes(b"payload"))
    reader.join(10)
    assert received == [b"payload"]
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)  # still a FIFO, as /dev/null stays a device


def test_atomic_replace_keeps_the_old_file_on_failure(tmp_path):
    target = tmp_path / "out.html"
    target.write_text("old")

    def broken(where):
        where.write_text("half")
        raise RuntimeError("crash mid-write")
    with pytest.raises(RuntimeError):
        write_output(target, broken)
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.html"]  # no stray temporary


@pytest.mark.parametrize("make, match", [
    (lambda d: d, "is a directory"),
    (lambda d: [(d / "file").write_text("x"), d / "file" / "out.trace"][1],
     "is not a directory"),
    (lambda d: d / ("x" * 300 + ".trace"), "too long"),
])
def test_unwritable_targets_are_named_before_the_work(tmp_path, make, match):
    with pytest.raises(UserError, match=match):
        check_output(make(tmp_path))


def test_relative_output_is_made_absolute_up_front(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    where = check_output("sub/out.trace")
    monkeypatch.chdir("/")
    assert where == tmp_path / "sub" / "out.trace"


def test_report_refuses_a_directory_before_building(tmp_path):
    trace = make_trace(tmp_path / "t.trace", 500)
    done = subprocess.run([sys.executable, "-m", "memadvisor.cli", "report", str(trace),
                           "-o", str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "is a directory" in done.stderr and "Traceback" not in done.stderr
