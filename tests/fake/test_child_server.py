"""Children forked from `profile_fake.ChildServer` record what fresh children record.

Verification runs many fake executions; the server imports torch once and forks each
run.  A forked run must be the fresh one: the same events in the same order (so the
same modelled peaks), its own device count, working folder and output.
"""
from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from memadvisor.commands.profile_fake import ChildServer, run_child
from memadvisor.errors import UserError
from memadvisor.trace.io import read_trace

SCRIPTS = Path(__file__).resolve().parent / "scripts"
#: what fake execution records identically on every run (not times, ids or addresses)
COLUMNS = ["action", "size_bytes", "device", "dtype", "shape", "category", "op", "module",
           "phase", "step", "source_file", "source_line"]

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="no C++ compiler")


def _spec(folder: Path, script: Path, rank: int, nproc: int = 2) -> dict:
    return {"script": str(script), "args": [], "output": str(folder / f"rank{rank}.trace"),
            "gpu": "h100-80gb", "nproc": nproc, "rank": rank, "steps": 2, "timeout_s": 120.0,
            "step_boundary": "auto", "quiet": True}


def test_forked_ranks_record_the_fresh_childrens_events(tmp_path):
    script = SCRIPTS / "fsdp_train.py"
    (tmp_path / "fresh").mkdir()
    (tmp_path / "forked").mkdir()
    fresh = [run_child(_spec(tmp_path / "fresh", script, rank), cwd=str(tmp_path),
                       capture=True) for rank in (0, 1)]
    with ChildServer() as server, ThreadPoolExecutor(2) as pool:
        forked = list(pool.map(
            lambda rank: run_child(_spec(tmp_path / "forked", script, rank),
                                   cwd=str(tmp_path), capture=True, server=server), (0, 1)))
    for rank, (one, other) in enumerate(zip(fresh, forked)):
        assert other["status"] == one["status"] == "completed"
        assert other["steps_completed"] == one["steps_completed"] == 2
        first, second = read_trace(one["trace_path"]), read_trace(other["trace_path"])
        assert second.meta.device == first.meta.device == f"cuda:{rank}"
        assert len(second.events) == len(first.events) > 100
        assert second.events[COLUMNS].equals(first.events[COLUMNS])


def test_a_forked_child_that_fails_says_why_in_one_line(tmp_path):
    script = tmp_path / "broken.py"
    script.write_text("import torch\nprint('about to fail')\nraise SystemExit(3)\n")
    with ChildServer() as server:
        result = run_child(_spec(tmp_path, script, 0, nproc=1), cwd=str(tmp_path),
                           capture=True, server=server)
        assert result["status"] != "completed"
        (tmp_path / "gone.py").write_text("import os\nos._exit(5)\n")
        with pytest.raises(UserError, match=r"ended without a result \(exit status 5\)"):
            run_child(_spec(tmp_path, tmp_path / "gone.py", 0, nproc=1), cwd=str(tmp_path),
                      capture=True, server=server)
