"""The fast CI subset of the accuracy matrix through real ``memadvisor apply --profile`` runs:
a few (example x plan) cases, predicted from the unmodified example's trace, each within 3%
and their median within 1% (docs/ACCURACY.md; the full matrix is
benchmarks/accuracy_matrix.py).  About 40 s on two cores."""
import os
import statistics
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import accuracy_matrix  # noqa: E402

CASES = {
    "gpt_lm": ["optimizer=sgd", "precision=amp-bf16"],
    # bf16 on CPU: oneDNN's matmul scratch blocks (device rule ``matmul_scratch``)
    # oneDNN's bf16 convolution blocks from the profiler's probes (meta.probes)
    "cnn_classifier": ["precision=amp-bf16,checkpoint=auto,accum=2"],
    "mlp_regressor": ["accum=2", "shard=ddp,world=2",
                      "precision=bf16,optimizer=sgd-momentum,accum=2"],
}


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    if not accuracy_matrix.apply_available():
        pytest.skip("memadvisor apply is not available")
    folder = str(tmp_path_factory.mktemp("matrix"))
    rows = []
    for example, plans in CASES.items():
        found, skipped = accuracy_matrix.example_cases(folder, [example], plans)
        assert not skipped, skipped
        rows += found
    return rows


def _error(row):
    _, _, predicted, measured, _ = row
    return abs(predicted - measured) / measured


def test_every_case_within_3_percent(measured):
    assert len(measured) == sum(len(p) for p in CASES.values())
    for row in measured:
        assert _error(row) <= 0.03, row


def test_median_within_1_percent(measured):
    assert statistics.median(_error(r) for r in measured) <= 0.01
