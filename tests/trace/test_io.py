"""Trace files: a round trip changes nothing; every broken file is one TraceError line;
a million events load in about a second.  No torch here: readers never need it."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from memadvisor.trace import (
    COLUMN_NAMES, FORMAT_VERSION, TraceError, TraceMeta, events_table, read_meta, read_trace,
    write_trace,
)
from memadvisor.trace.schema import METADATA_KEY

MODULES = ["", "blocks.0.attn", "blocks.0.mlp.fc", "blocks.1.attn", "lm_head", "héad.ü"]
OPS = ["aten::mm", "aten::addmm", "aten::empty", "", "aten::_foreach_add"]
CATEGORIES = ["parameter", "gradient", "optimizer_state", "activation", "temporary", "input"]


def synthetic_columns(n: int, seed: int = 0) -> dict[str, object]:
    """``n`` events: n/2 storages, each allocated then freed, with plausible columns."""
    rng = np.random.default_rng(seed)
    half = n // 2
    sids = np.concatenate([np.arange(half), rng.permutation(half)])
    order = np.argsort(np.concatenate([np.arange(half) * 2, np.arange(half) * 2 + 1
                                       + rng.integers(0, 50, half) * 2]), kind="stable")
    sids = sids[order] if n % 2 == 0 else np.append(sids[order], half)
    first = np.zeros(len(sids), dtype=bool)
    _, first_pos = np.unique(sids, return_index=True)
    first[first_pos] = True
    sizes_by_sid = rng.integers(1, 1 << 33, half + 1)  # beyond 32 bits on purpose
    pick = lambda values: [values[i] for i in rng.integers(0, len(values), len(sids))]
    return {
        "seq": np.arange(len(sids), dtype=np.int64),
        "time_ns": np.cumsum(rng.integers(0, 1000, len(sids))).astype(np.int64),
        "action": np.where(first, "alloc", "free").tolist(),
        "storage_id": sids.astype(np.int64),
        "size_bytes": sizes_by_sid[sids].astype(np.int64),
        "device": ["cpu"] * len(sids),
        "dtype": pick(["float32", "bfloat16", "int64"]),
        "shape": pick(["", "4,32", "256,64", "1"]),
        "category": pick(CATEGORIES),
        "op": pick(OPS),
        "module": pick(MODULES),
        "phase": pick(["forward", "backward", "optimizer", "other"]),
        "step": np.sort(rng.integers(0, 4, len(sids))).astype(np.int32),
        "source_file": pick(["/home/u/train.py", "", "/home/u/model.py"]),
        "source_line": rng.integers(0, 500, len(sids)).astype(np.int32),
        "source_function": pick(["forward", "<module>", "main", ""]),
        "block_bytes": np.where(rng.random(len(sids)) < 0.5, 0,
                                sizes_by_sid[sids] + 511).astype(np.int64),
        "stream": rng.integers(0, 3, len(sids)).astype(np.int64),
        "address": rng.integers(0, 1 << 45, len(sids)).astype(np.int64),
        # data flow: an op's output names up to three storages read (any ids: the reader
        # keeps what was written)
        "input_ids": [sorted(rng.integers(0, half + 1, int(k)).tolist()) if is_first else []
                      for is_first, k in zip(first, rng.integers(0, 4, len(sids)))],
    }


def synthetic_meta() -> TraceMeta:
    return TraceMeta(
        script="/home/u/train.py", argv=["/home/u/train.py", "--lr", "1e-3"], cwd="/home/u",
        torch_version="2.13.0", status="error", error="RuntimeError: boom",
        steps_requested=3, steps_completed=2, step_detection="optimizer",
        parameter_count=123, parameter_bytes=492, buffer_bytes=8,
        optimizers=[{"class": "AdamW", "hyperparameters": {"lr": 0.001, "betas": [0.9, 0.95],
                                                           "foreach": None}}],
        modules=[{"path": "", "type": "GPT", "parameter_bytes": 0, "parameter_count": 0,
                  "buffer_bytes": 0, "total_parameter_bytes": 492, "repeated": False}],
        batch={"batch_size": 4, "shapes": [[4, 32]], "dtypes": ["int64"]},
        steps=[{"index": 0, "start_ns": 0, "end_ns": 10, "duration_s": 1e-8, "peak_bytes": 7,
                "cuda_max_allocated_bytes": None, "cuda_max_reserved_bytes": None}],
        autocast={"enabled": True, "dtype": "bfloat16"},
        extra={"note": "ünïcode ✓"},
    )


@pytest.fixture
def small_trace(tmp_path):
    path = tmp_path / "small.trace"
    write_trace(path, events_table(synthetic_columns(1000)), synthetic_meta())
    return path


def _assert_one_line_error(path, match: str):
    with pytest.raises(TraceError) as info:
        read_trace(path)
    message = str(info.value)
    assert message and "\n" not in message, repr(message)
    assert str(path) in message
    assert match in message, message
    return message


# --- round trip ------------------------------------------------------------------------
def test_round_trip_keeps_every_column_and_the_metadata(tmp_path, small_trace):
    columns = synthetic_columns(1000)
    trace = read_trace(small_trace)
    events = trace.events
    assert list(events.columns) == list(COLUMN_NAMES)
    for name in COLUMN_NAMES:
        # the values written come back, whatever dtype the reader chose
        if name == "input_ids":
            assert [list(v) for v in events[name]] == columns[name]
            continue
        assert list(events[name].astype(object if isinstance(columns[name], list) else
                                        events[name].dtype)) == list(columns[name]), name
    assert trace.meta.to_dict() == synthetic_meta().to_dict()

    # a trace read back and written again (from its DataFrame, and from its table) is
    # the same trace, column by column with the same dtypes
    again = tmp_path / "again.trace"
    write_trace(again, trace.events, trace.meta)
    reread = read_trace(again)
    pd.testing.assert_frame_equal(reread.events, trace.events, check_exact=True)
    for name in COLUMN_NAMES:
        assert reread.events[name].dtype == trace.events[name].dtype, name
    assert reread.meta.to_dict() == trace.meta.to_dict()

    from_table = tmp_path / "from_table.trace"
    write_trace(from_table, pq.read_table(small_trace), trace.meta)
    pd.testing.assert_frame_equal(read_trace(from_table).events, trace.events, check_exact=True)


def test_column_types_on_disk_follow_the_schema(small_trace):
    schema = pq.read_schema(small_trace)
    assert schema.names == list(COLUMN_NAMES)
    for name in ("seq", "time_ns", "storage_id", "size_bytes"):
        assert schema.field(name).type == pa.int64(), name
    for name in ("step", "source_line"):
        assert schema.field(name).type == pa.int32(), name
    for name in ("action", "category", "module", "op", "source_file"):
        assert pa.types.is_dictionary(schema.field(name).type), name


def test_empty_trace_round_trips(tmp_path):
    path = tmp_path / "empty_events.trace"
    write_trace(path, events_table({name: [] for name in COLUMN_NAMES}), TraceMeta())
    trace = read_trace(path)
    assert len(trace) == 0
    assert list(trace.events.columns) == list(COLUMN_NAMES)
    assert trace.meta.to_dict() == TraceMeta().to_dict()


def test_read_meta_reads_only_the_metadata(small_trace):
    assert read_meta(small_trace).to_dict() == synthetic_meta().to_dict()


def test_write_is_atomic_and_leaves_no_temporary(tmp_path, small_trace):
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small.trace"]


def test_unknown_metadata_keys_are_kept(tmp_path, small_trace):
    """A key written by a later memadvisor of the same format version is not dropped."""
    table = pq.read_table(small_trace)
    data = json.loads(table.schema.metadata[METADATA_KEY])
    data["future_field"] = {"x": 1}
    path = tmp_path / "future_key.trace"
    pq.write_table(table.replace_schema_metadata({METADATA_KEY: json.dumps(data)}), path)
    assert read_meta(path).extra["future_field"] == {"x": 1}


# --- every broken file is one TraceError line -------------------------------------------
def test_missing_file(tmp_path):
    _assert_one_line_error(tmp_path / "nope.trace", "no such trace file")


def test_directory(tmp_path):
    _assert_one_line_error(tmp_path, "directory")


def test_empty_file(tmp_path):
    path = tmp_path / "empty.trace"
    path.write_bytes(b"")
    _assert_one_line_error(path, "empty")


def test_garbage_file(tmp_path):
    path = tmp_path / "garbage.trace"
    path.write_bytes(np.random.default_rng(1).bytes(4096))
    _assert_one_line_error(path, "not a readable trace file")


def test_text_file(tmp_path):
    path = tmp_path / "notes.trace"
    path.write_text("step,bytes\n0,12\n1,13\nPAR1\n")
    _assert_one_line_error(path, "not a readable trace file")


def test_truncated_file(tmp_path, small_trace):
    data = small_trace.read_bytes()
    path = tmp_path / "truncated.trace"
    path.write_bytes(data[: len(data) // 2])
    _assert_one_line_error(path, "not a readable trace file")


def test_damaged_data_with_an_intact_footer(tmp_path, small_trace):
    """The metadata still reads, but the column data is garbage: still one line."""
    data = bytearray(small_trace.read_bytes())
    footer_length = int.from_bytes(data[-8:-4], "little")
    body_end = len(data) - 8 - footer_length
    rng = np.random.default_rng(2)
    data[4:body_end] = rng.bytes(body_end - 4)
    path = tmp_path / "damaged.trace"
    path.write_bytes(bytes(data))
    assert read_meta(path).to_dict() == synthetic_meta().to_dict()
    _assert_one_line_error(path, "damaged")


def test_parquet_that_is_not_a_trace(tmp_path):
    path = tmp_path / "other.parquet"
    pq.write_table(pa.table({"a": [1, 2, 3]}), path)
    _assert_one_line_error(path, "not a memadvisor trace")


def test_parquet_with_foreign_metadata_document(tmp_path):
    path = tmp_path / "foreign.parquet"
    table = pa.table({"a": [1]}).replace_schema_metadata(
        {METADATA_KEY: json.dumps({"format": "something-else", "format_version": 1})})
    pq.write_table(table, path)
    _assert_one_line_error(path, "not a memadvisor trace")


def test_damaged_metadata_document(tmp_path, small_trace):
    table = pq.read_table(small_trace).replace_schema_metadata({METADATA_KEY: b"{not json"})
    path = tmp_path / "bad_meta.trace"
    pq.write_table(table, path)
    _assert_one_line_error(path, "metadata")


def test_newer_format_version(tmp_path, small_trace):
    meta = synthetic_meta()
    meta.format_version = FORMAT_VERSION + 1
    path = tmp_path / "newer.trace"
    write_trace(path, pq.read_table(small_trace), meta)
    message = _assert_one_line_error(path, f"version {FORMAT_VERSION + 1}")
    assert "upgrade" in message


def test_missing_format_version(tmp_path, small_trace):
    table = pq.read_table(small_trace)
    data = json.loads(table.schema.metadata[METADATA_KEY])
    del data["format_version"]
    path = tmp_path / "no_version.trace"
    pq.write_table(table.replace_schema_metadata({METADATA_KEY: json.dumps(data)}), path)
    _assert_one_line_error(path, "version")


def test_missing_columns(tmp_path, small_trace):
    table = pq.read_table(small_trace).drop(["size_bytes", "category"])
    path = tmp_path / "few_columns.trace"
    write_trace(path, table, synthetic_meta())
    _assert_one_line_error(path, "size_bytes")


def test_a_column_of_the_wrong_type(tmp_path, small_trace):
    table = pq.read_table(small_trace)
    index = table.column_names.index("size_bytes")
    as_text = pa.array([str(v) for v in table.column("size_bytes").to_pylist()])
    path = tmp_path / "wrong_type.trace"
    write_trace(path, table.set_column(index, "size_bytes", as_text), synthetic_meta())
    _assert_one_line_error(path, "size_bytes")


# --- speed ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def million_event_trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("big") / "million.trace"
    write_trace(path, events_table(synthetic_columns(1_000_000, seed=3)), synthetic_meta())
    return path


def test_a_million_events_load_in_about_a_second(million_event_trace):
    started = time.perf_counter()
    trace = read_trace(million_event_trace)
    elapsed = time.perf_counter() - started
    size_mb = million_event_trace.stat().st_size / 1e6
    print(f"read_trace: 1,000,000 events ({size_mb:.1f} MB) in {elapsed:.2f} s")
    assert len(trace) == 1_000_000
    assert trace.events["size_bytes"].dtype == np.int64
    assert elapsed < 5.0  # about 1 s on an idle machine; generous for a loaded one
    assert size_mb < 40


def test_reading_a_trace_imports_no_torch(small_trace):
    code = ("import sys; from memadvisor.trace import read_trace; "
            "from memadvisor.trace.summary import summarize; "
            f"summarize(read_trace({str(small_trace)!r})); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr


# --- format 1 ---------------------------------------------------------------------------
def test_format_1_file_reads_with_zero_allocator_columns(tmp_path):
    """A trace written before the allocator columns existed loads: blocks not known (0),
    so every reader counts the storage's bytes as before."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from memadvisor.trace import analysis
    from memadvisor.trace.schema import OPTIONAL_ZERO_COLUMNS

    path = tmp_path / "v1.trace"
    write_trace(path, events_table(synthetic_columns(200)), synthetic_meta())
    table = pq.read_table(path)
    old = table.drop_columns(list(OPTIONAL_ZERO_COLUMNS))
    data = json.loads(table.schema.metadata[METADATA_KEY])
    data["format_version"] = 1
    pq.write_table(old.replace_schema_metadata({METADATA_KEY: json.dumps(data)}), path)
    trace = read_trace(path)
    assert trace.meta.format_version == FORMAT_VERSION
    for name in OPTIONAL_ZERO_COLUMNS:
        assert (trace.events[name] == 0).all()
    assert list(analysis.counted_bytes(trace.events)) == list(trace.events["size_bytes"])


def test_format_2_file_reads_with_empty_data_flow(tmp_path):
    """A trace written before the data flow column existed loads with every row's
    ``input_ids`` empty, and writes back as the current format."""
    import pyarrow.parquet as pq
    from memadvisor.trace.io import id_lists

    path = tmp_path / "v2.trace"
    write_trace(path, events_table(synthetic_columns(200)), synthetic_meta())
    table = pq.read_table(path)
    data = json.loads(table.schema.metadata[METADATA_KEY])
    data["format_version"] = 2
    old = table.drop_columns(["input_ids"])
    pq.write_table(old.replace_schema_metadata({METADATA_KEY: json.dumps(data)}), path)
    trace = read_trace(path)
    assert trace.meta.format_version == FORMAT_VERSION == 3
    offsets, values = id_lists(trace.events)
    assert len(offsets) == len(trace.events) + 1 and not offsets.any() and not len(values)
    again = tmp_path / "again.trace"
    write_trace(again, trace.events, trace.meta)
    assert [list(v) for v in read_trace(again).events["input_ids"]] == [[]] * 200


def test_block_bytes_count_where_known():
    """A CUDA trace's peak counts the allocator's blocks, as max_memory_allocated does."""
    import pandas as pd
    from memadvisor.trace import analysis
    events = pd.DataFrame({"action": ["alloc", "alloc", "free", "free"],
                           "size_bytes": [100, 3000, 100, 3000],
                           "block_bytes": [512, 0, 512, 0]})
    assert list(analysis.live_bytes(events)) == [512, 3512, 3000, 0]
