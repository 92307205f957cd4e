"""Fuzzing what users hand us -- trace metadata and plans -- for tracebacks: every case is
either read or refused with one line (TraceError / PlanError), never anything else.
Seeded (derandomized) and bounded, so CI sees the same 10,000+ cases every run."""
from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memadvisor.plan import KEYS, Plan, PlanError
from memadvisor.report.synthetic import make_trace
from memadvisor.trace import io as trace_io
from memadvisor.trace.io import Trace, TraceError
from memadvisor.trace.schema import METADATA_KEY, TraceMeta
from memadvisor.trace.summary import summarize, summary_text

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                  max_size=4),
    max_leaves=12)
META_KEYS = list(TraceMeta.__dataclass_fields__)
FUZZ = settings(max_examples=5_000, derandomize=True, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = make_trace(tmp_path_factory.mktemp("fuzz") / "t.trace", 60)
    table = pq.read_table(path)
    return path, json.loads(table.schema.metadata[METADATA_KEY]), trace_io.read_trace(path)


@FUZZ
@given(changes=st.dictionaries(st.sampled_from(META_KEYS + ["x"]), JSON, min_size=1,
                               max_size=3))
def test_metadata_is_read_or_refused_in_one_line(base, changes):
    path, good, trace = base
    data = {**good, **changes}
    schema = pq.read_schema(path).with_metadata({METADATA_KEY: json.dumps(data)})
    try:
        meta = trace_io._meta_from_schema(path, schema)
    except TraceError as exc:
        assert "\n" not in str(exc)
        return
    # what is accepted, every reader can use
    summary = summarize(Trace(trace.events, meta, str(path)))
    summary_text(summary)


@FUZZ
@given(data=st.dictionaries(st.sampled_from(list(KEYS) + ["bogus"]), JSON, max_size=4))
def test_plans_are_read_or_refused_in_one_line(data):
    try:
        plan = Plan.from_dict(data)
    except PlanError as exc:
        assert "\n" not in str(exc)
        return
    Plan.parse_spec(plan.to_compact())  # an accepted plan round-trips


def test_deeply_nested_plan_file_is_refused(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(PlanError, match="nested too deep|must hold a JSON object"):
        Plan.parse(str(path))
