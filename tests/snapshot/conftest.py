"""Real CUDA allocator snapshots (MIT, see tests/fixtures/gpu_truth/LICENSE) imported once
per session; ../shared/gpu-truth holds more (the K files: benchmarks only, no licence)."""
from __future__ import annotations

from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "gpu_truth"
W_SNAPSHOTS = sorted(FIXTURES.glob("W_medium_*_training.pickle.gz"))


@pytest.fixture(scope="session")
def imported(tmp_path_factory):
    """name -> (snapshot dict, trace path) for every committed snapshot."""
    from memadvisor.snapshot import load_snapshot
    from memadvisor.snapshot.importer import import_snapshot

    out = {}
    folder = tmp_path_factory.mktemp("imported")
    for path in W_SNAPSHOTS:
        name = path.name.split(".")[0]
        trace_path = folder / f"{name}.trace"
        import_snapshot(path, trace_path)
        out[name] = (load_snapshot(path), trace_path)
    return out
