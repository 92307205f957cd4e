"""Values, not only types: a well-formed trace file holding nonsense is refused at read
time in one line (exit 2), never passed by `check --budget` nor shown as if it were a run."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from memadvisor.cli import main
from memadvisor.report.synthetic import make_trace
from memadvisor.trace.schema import METADATA_KEY


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return make_trace(tmp_path_factory.mktemp("values") / "good.trace", 400, hostile=False)


def _with_column(table: pa.Table, name: str, values, kind=None) -> pa.Table:
    return table.set_column(table.column_names.index(name), name, pa.array(values, kind))


def _sizes(table: pa.Table, index: int, value, kind=pa.int64()) -> pa.Table:
    sizes = table.column("size_bytes").to_pylist()
    sizes[index] = value
    return _with_column(table, "size_bytes", sizes, kind)


def _action(table: pa.Table, value: str) -> pa.Table:
    actions = table.column("action").to_pylist()
    actions[5] = value
    return _with_column(table, "action", actions, pa.string())


def _meta(table: pa.Table, **changes) -> pa.Table:
    data = json.loads(table.schema.metadata[METADATA_KEY])
    return table.replace_schema_metadata({METADATA_KEY: json.dumps({**data, **changes})})


def _check(path, capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["check", str(path), "--budget", "1TiB"])
    return code, capsys.readouterr().err


def test_the_untouched_trace_passes(good, capsys):
    """The baseline every case below spoils: this trace fits a 1 TiB budget."""
    assert _check(good, capsys)[0] == 0


@pytest.mark.parametrize("spoil, expected", [
    (lambda t: _sizes(t, 10, -4096), "negative size_bytes"),
    (lambda t: _sizes(t, 10, None), "missing values"),
    (lambda t: _sizes(t, 10, 2**63 + 8, pa.uint64()), "size_bytes beyond 2**63"),
    (lambda t: _action(t, "realloc"), "unknown action 'realloc'"),
    (lambda t: t.take(pa.array(range(t.num_rows - 1, -1, -1))), "events out of order"),
    (lambda t: _meta(t, format_version=-1), "no valid format version (-1)"),
    (lambda t: _meta(t, format_version=True), "no valid format version (True)"),
    (lambda t: _meta(t, format_version="2"), "no valid format version ('2')"),
    (lambda t: _meta(t, steps_completed=-3), "steps_completed is negative"),
    (lambda t: _meta(t, steps=[{"index": "one"}]), "a step's index is 'one'"),
], ids=["negative-size", "null-size", "uint64-size", "unknown-action", "reversed",
        "version-minus-one", "version-true", "version-text", "negative-steps", "step-index-text"])
def test_nonsense_values_are_refused_in_one_line(good, tmp_path, capsys, spoil, expected):
    path = tmp_path / "spoiled.trace"
    pq.write_table(spoil(pq.read_table(good)), path)
    code, err = _check(path, capsys)
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert expected in err, err


def _nested(table: pa.Table, name: str, change) -> pa.Table:
    data = json.loads(table.schema.metadata[METADATA_KEY])
    change(data[name])
    return table.replace_schema_metadata({METADATA_KEY: json.dumps(data)})


@pytest.mark.parametrize("spoil, expected", [
    (lambda t: _nested(t, "modules", lambda m: m[1].pop("path")), "modules[1] has no path"),
    (lambda t: _nested(t, "modules", lambda m: m[1].update(parameter_bytes="x")),
     "modules[1].parameter_bytes is 'x', not a count"),
    (lambda t: _nested(t, "batch", lambda b: b.update(batch_size=8, shapes=[[8, {"a": 1}]])),
     "batch.shapes[0][1] is {'a': 1}, not a count"),
    (lambda t: _nested(t, "op_stats", lambda o: o.append({"op": "aten::mm", "flops": "x"})),
     "op_stats[0].flops is 'x', not a number >= 0"),
    (lambda t: _nested(t, "probes", lambda p: p.update(
        linear=[{"module": "m", "bfloat16": {"forward": [1, -2]}}])),
     "probes.linear[0].bfloat16.forward[1] is -2, not a count"),
    (lambda t: _nested(t, "optimizers", lambda o: o[0].update(state_bytes=None)),
     "optimizers[0].state_bytes is None, not a count"),
], ids=["module-without-path", "module-bytes-text", "batch-shape-object", "flops-text",
        "probe-negative", "optimizer-state-null"])
def test_nested_metadata_readers_index_is_checked_at_read_time(good, tmp_path, capsys, spoil,
                                                                expected):
    """simulate and advise indexed these (a KeyError or ValueError traceback each)."""
    path = tmp_path / "spoiled.trace"
    pq.write_table(spoil(pq.read_table(good)), path)
    capsys.readouterr()
    assert main(["simulate", str(good), "--plan", "accum=2"]) == 0
    capsys.readouterr()
    assert main(["simulate", str(path), "--plan", "accum=2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err, err


def test_an_error_quoting_the_file_cannot_drive_the_terminal(good, tmp_path, capsys):
    path = tmp_path / "spoiled.trace"
    pq.write_table(_nested(pq.read_table(good), "probes",
                           lambda p: p.update({"\x1b]0;pwned\x07": "x"})), path)
    code, err = _check(path, capsys)
    assert code == 2 and "\x1b" not in err and "\\x1b]0;pwned\\x07" in err, err
