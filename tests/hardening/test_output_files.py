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


def _device_like_dev_null(folder):
    """A character device node (1, 3: what /dev/null is) in the test's folder, so no test
    ever writes at the machine's own /dev/null; making one needs root (CAP_MKNOD)."""
    node = folder / "null"
    try:
        os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        with open(node, "wb") as handle:  # a nodev mount refuses to open it
            handle.write(b"")
    except OSError as exc:
        pytest.skip(f"cannot make a device node here ({exc.strerror})")
    return node


def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "memadvisor.cli", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=240)


def test_commands_write_into_a_device_node_and_leave_it_a_device(tmp_path):
    """`-o /dev/null` as root turned the machine's /dev/null into a plain file: every
    command that writes a file (profile's checkpoints and final trace included) must write
    into a device, never replace it."""
    node = _device_like_dev_null(tmp_path)
    trace = make_trace(tmp_path / "t.trace", 300)
    script = tmp_path / "train.py"
    script.write_text("import torch\nm = torch.nn.Linear(4, 4)\n"
                      "o = torch.optim.SGD(m.parameters(), lr=0.1)\n"
                      "for _ in range(3):\n    m(torch.randn(2, 4)).sum().backward()\n"
                      "    o.step()\n    o.zero_grad()\n")
    for args in (["report", trace, "-o", node], ["export-snapshot", trace, "-o", node],
                 ["profile", script, "-o", node, "--steps", "2", "-q"]):
        done = _cli(*args, cwd=tmp_path)
        assert done.returncode == 0, (args[0], done.stderr)
        assert stat.S_ISCHR(os.lstat(node).st_mode), f"{args[0]} replaced the device"
        assert os.major(os.lstat(node).st_rdev) == 1 and os.minor(os.lstat(node).st_rdev) == 3
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_commands_write_through_a_symlink(tmp_path):
    trace = make_trace(tmp_path / "t.trace", 300)
    real = tmp_path / "kept" / "memory.html"
    real.parent.mkdir()
    real.write_text("old")
    link = tmp_path / "latest.html"
    link.symlink_to(real)
    done = _cli("report", trace, "-o", link, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert real.read_text().startswith("<!DOCTYPE html>")
