"""A snapshot file is data: anything that would run code, or is not a snapshot, is
refused with one line, and nothing in it is executed."""
from __future__ import annotations

import gzip
import os
import pickle
import subprocess
import sys

import pytest

from memadvisor.snapshot import SnapshotError, load_snapshot

from .conftest import W_SNAPSHOTS


class _Exploit:
    """Unpickling this runs a shell command (what pickle.load would do)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _refused(path, match):
    with pytest.raises(SnapshotError) as info:
        load_snapshot(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message and match in message, message
    return message


def test_malicious_pickle_is_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pickle"
    evil.write_bytes(pickle.dumps({"segments": [], "x": _Exploit(marker)}, protocol=4))
    _refused(evil, "posix.system")
    assert not marker.exists()
    # sanity: the same file really would run the command under pickle.load
    subprocess.run([sys.executable, "-c", f"import pickle; pickle.load(open({str(evil)!r}, 'rb'))"],
                   check=True)
    assert marker.exists()


def test_truncated_and_garbage_and_foreign_files_are_refused(tmp_path):
    data = gzip.decompress(W_SNAPSHOTS[0].read_bytes())
    cut = tmp_path / "cut.pickle"
    cut.write_bytes(data[: len(data) // 2])
    _refused(cut, "not a readable pickle (UnpicklingError: pickle data was truncated)")
    garbage = tmp_path / "garbage.pickle"
    garbage.write_bytes(b"this is not a pickle at all\n")
    _refused(garbage, "")
    listing = tmp_path / "list.pickle"
    listing.write_bytes(pickle.dumps([1, 2, 3]))
    _refused(listing, "not a CUDA memory snapshot")
    with_set = tmp_path / "set.pickle"
    with_set.write_bytes(pickle.dumps({"segments": [], "s": {1, 2}}))
    _refused(with_set, "set")
    broken = tmp_path / "broken.pickle"
    broken.write_bytes(pickle.dumps({"segments": [{"address": 1}], "device_traces": []}))
    _refused(broken, "damaged snapshot")
    empty = tmp_path / "empty.pickle"
    empty.write_bytes(b"")
    _refused(empty, "empty")
    _refused(tmp_path / "missing.pickle", "no such file")


def test_shared_references_and_deep_nesting(tmp_path):
    """A pickle can reference one list many times (memo): the type walk visits it once,
    or this 2**50-path structure would never finish; nesting no snapshot has is refused."""
    inner = [0]
    for _ in range(50):
        inner = [inner, inner]
    path = tmp_path / "wide.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [], "wide": inner}))
    assert load_snapshot(path)["segments"] == []
    deep = [1]
    for _ in range(200):
        deep = [deep]
    path = tmp_path / "deep.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "deep": deep}))
    _refused(path, "nesting")


def test_cli_refuses_with_one_line_and_exit_2(tmp_path):
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pickle"
    evil.write_bytes(pickle.dumps(_Exploit(marker), protocol=2))
    done = subprocess.run([sys.executable, "-m", "memadvisor.cli", "import-snapshot", str(evil),
                           "-o", str(tmp_path / "out.trace")], capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "refused" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert not marker.exists() and not (tmp_path / "out.trace").exists()
