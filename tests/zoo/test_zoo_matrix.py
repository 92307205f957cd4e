"""The real-world matrix in CI: every zoo script x {profile, advise, apply accum=2, apply
zero2 on 2 ranks}, judged as ``benchmarks/zoo_matrix.py`` judges them (its docstring):
each cell either works (steps and batch right; parameters equal the unmodified run's where
the split is exact; the plan's signature in the applied trace) or is refused before
running with one line naming the knob -- never a crash, never exit 0 with the plan not
applied or wrong.  About 40 s per script on 2 cores; framework scripts skip without the
``zoo`` extra.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from zoo_scripts import load_benchmark, zoo_scripts

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = {s.name: s for s in zoo_scripts()}


def _matrix():
    return load_benchmark("zoo_matrix")


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_every_cell_works_or_is_refused_before_running(name, tmp_path):
    script = SCRIPTS[name]
    if script.missing_package():
        pytest.skip(f"{script.missing_package()} not installed (pip install -e '.[zoo]')")
    matrix = _matrix()
    row = matrix.run_script(script, tmp_path, steps_flag=True)
    verdicts = {cell: row[cell]["verdict"] for cell in matrix.CELLS}
    bad = {cell: f"{row[cell]['verdict']}: {row[cell]['detail']}"
           for cell, verdict in verdicts.items() if verdict not in ("works", "refused")}
    assert not bad, bad
    # profiling and advice work on every script, framework or not
    assert verdicts["profile"] == "works" and verdicts["advise"] == "works", row
    for cell in ("accum", "zero2"):
        if verdicts[cell] == "refused":
            assert row[cell]["detail"].strip(), f"{cell} refused without a reason"


def test_a_split_counts_the_replicas_not_the_tensor_parallel_ranks():
    """advise's answer naming accum=8 on 2 GPUs that share one replica by tensor parallelism
    cuts a batch of 8 into 8 parts, not 16 (zoo/convnext's no-fit answer)."""
    matrix = _matrix()
    answer = "the smallest plan (checkpoint=auto,accum=8,world=2,tp=2) needs 3.06 MiB"
    assert matrix._impossible_split(answer, 8) == ""
    assert "16 parts" in matrix._impossible_split("(accum=8,world=2)", 8)
