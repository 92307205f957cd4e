"""Snapshots recorded on a real H100 (2026-11-25, torch 2.11.0+cu130) of this project's own
scripts: one training step each (step 3, after two warm-up steps), beside the figures torch
itself reported for that step (tests/fixtures/gpu_h100/truth.json, written by
benchmarks/gpu_real/record.py with nothing of memadvisor in the process).

The import replays the recorded addresses through the allocator's split/merge rules; its
peak allocated and reserved must be the ones ``max_memory_allocated`` and
``max_memory_reserved`` gave for that step, to the byte."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from memadvisor.snapshot.importer import import_snapshot

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "gpu_h100"
TRUTH = json.loads((FIXTURES / "truth.json").read_text())
SNAPSHOTS = sorted(FIXTURES.glob("*_step3.pickle.gz"))


def test_the_fixtures_are_there():
    assert len(SNAPSHOTS) == 5


@pytest.mark.parametrize("path", SNAPSHOTS, ids=lambda p: p.name.split("_step")[0])
def test_an_h100_step_imports_to_torchs_own_peaks(path, tmp_path):
    name = path.name.split("_step")[0]
    result = import_snapshot(path, tmp_path / f"{name}.trace")
    allocated, reserved = TRUTH["cases"][name]["steps"][2]  # the third step's peaks
    assert result["block_mismatches"] == 0 and result["blocks_checked"] > 80
    assert result["peak_allocated_bytes"] == allocated
    assert result["peak_reserved_bytes"] == reserved
