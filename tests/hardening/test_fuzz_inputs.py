"""Fuzzing what users hand us -- trace metadata and plans -- for tracebacks: every case is
either read or refused with one line (TraceError / PlanError), never anything else.
Seeded (derandomized) and bounded, so CI sees the same 10,000+ cases every run."""
from __future__ import annotations

import json
from pathlib import Path

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
#: plan files: each case writes a file, so fewer
FILES = settings(FUZZ, max_examples=1_000)


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


# -- one value deep inside a real trace's metadata, through the commands that read it ------
REAL = Path(__file__).resolve().parents[1] / "fixtures" / "gpt_lm_whole_model_checkpoint.trace"
#: what a profile of today writes beside the fixture's (older) metadata: the batch's dims and
#: names, a probe of a Linear's 16-bit kernel blocks
EXTRA_META = {
    "batch": {"batch_size": 8, "shapes": [[8, 32], [8, 32]], "dtypes": ["int64", "int64"],
              "names": ["args[0]", "args[1]"], "batch_dims": [0, 0], "evidence": "sizes"},
    "probes": {"linear": [{"module": "head", "input_shape": [8, 32, 128], "threads": 1,
                           "rows": [256, 128], "float32_blocks": 0,
                           "bfloat16": {"forward": [74752, 41984],
                                        "input_gradient": [74752, 41984],
                                        "weight_gradient": [83072, 50304]}}]},
}
COMMANDS = (["summary"], ["check", "--budget", "1TiB"],
            ["simulate", "--plan", "precision=amp-bf16,accum=2"])


def _places(value, prefix=()):
    """Every place in the metadata a value sits (lists: their first three items)."""
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _places(item, prefix + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value[:3]):
            yield from _places(item, prefix + (index,))


@pytest.fixture(scope="module")
def real_meta():
    table = pq.read_table(REAL)
    data = {**json.loads(table.schema.metadata[METADATA_KEY]), **EXTRA_META}
    places = [p for p in _places(data) if p and p[0] not in ("format", "format_version")]
    return table, data, places


@settings(max_examples=25, derandomize=True, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(draw=st.data())
def test_a_value_deep_in_real_metadata_is_read_or_refused_by_every_command(real_meta,
                                                                           tmp_path_factory,
                                                                           draw):
    """Each command either works or says one line: a module entry without its path, a
    batch shape holding an object, a probe's negative block (simulate and advise raised
    KeyError/TypeError on such traces before they were checked at read time)."""
    import contextlib
    import copy
    import io

    from memadvisor.cli import main

    table, data, places = real_meta
    data = copy.deepcopy(data)
    place = draw.draw(st.sampled_from(places))
    holder = data
    for key in place[:-1]:
        holder = holder[key]
    if draw.draw(st.booleans()) and isinstance(holder, dict):
        del holder[place[-1]]
    else:
        holder[place[-1]] = draw.draw(JSON)
    path = tmp_path_factory.mktemp("deep") / "t.trace"
    pq.write_table(table.replace_schema_metadata({METADATA_KEY: json.dumps(data)}), path)
    for command in COMMANDS:
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            code = main([command[0], str(path), *command[1:]])
        assert code in (0, 1, 2), (command, code)
        if code == 2:
            assert err.getvalue().count("\n") == 1, (command, err.getvalue())
            break  # refused when read: every command alike


def test_plan_files_are_read_or_refused_in_one_line(tmp_path):
    """Plan files as a user writes them: any JSON document (not only objects)."""
    path = tmp_path / "plan.json"

    @FILES
    @given(document=JSON | st.dictionaries(st.sampled_from(list(KEYS) + ["bogus"]), JSON,
                                           max_size=4))
    def read_or_refuse(document):
        path.write_text(json.dumps(document))
        try:
            Plan.parse(str(path))
        except PlanError as exc:
            assert "\n" not in str(exc)

    read_or_refuse()
