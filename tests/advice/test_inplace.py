"""The in-place advice on a trace written event by event: which ops it suggests, which it
refuses and why, and the peak drop -- checked against the trace edited as the in-place
change would make it (the output's storage never made, the input's kept until the
output's free)."""
import numpy as np
import pytest

from memadvisor.advice import MISSING, REFUSED, SUGGESTED, collect
from memadvisor.advice.inplace import inplace_advice
from memadvisor.simulate import hardware
from memadvisor.trace.analysis import live_bytes

from .traces import load, write_events

F, B, O = "forward", "backward", "other"
KB = 1000

#: P, Q parameters; x the batch the loop holds; d = Q * 2 (a parameter's in-place: refused);
#: a = x @ P; e = x * 2 (x's last reader, but the batch: refused); b = relu(a) (a dies right after: suggested;
#: the relu kernel's scratch makes that moment the peak); c = gelu(b) (b lives into the
#: backward, saved by gelu: refused); a loss and its backward
EVENTS = [
    ("alloc", 1, 1 * KB, "parameter", "aten::empty", O, [], 0),
    ("alloc", 2, 4 * KB, "parameter", "aten::empty", O, [], 0),
    ("alloc", 3, 4 * KB, "input", "aten::randn", O, [], 5),
    ("alloc", 7, 4 * KB, "temporary", "aten::mul", F, [2], 13),
    ("free", 7, 0, "", "", F, [], 0),
    ("alloc", 4, 4 * KB, "activation", "aten::addmm", F, [3, 1], 10),
    ("alloc", 8, 4 * KB, "temporary", "aten::mul", F, [3], 14),
    ("free", 8, 0, "", "", F, [], 0),
    ("alloc", 5, 4 * KB, "activation", "aten::relu", F, [4], 11),
    ("alloc", 11, 3 * KB, "temporary", "aten::relu", F, [], 11),
    ("free", 11, 0, "", "", F, [], 0),
    ("free", 4, 0, "", "", F, [], 0),
    ("alloc", 6, 4 * KB, "activation", "aten::gelu", F, [5], 12),
    ("alloc", 9, 100, "temporary", "aten::sum", F, [6], 15),
    ("alloc", 10, 1 * KB, "gradient", "aten::gelu_backward", B, [9, 5], 15),
    ("free", 6, 0, "", "", B, [], 0),
    ("free", 5, 0, "", "", B, [], 0),
    ("free", 10, 0, "", "", B, [], 0),
    ("free", 9, 0, "", "", B, [], 0),
]


def peak_after_inplace(events: list[tuple], output: int, source: int) -> int:
    """The trace as the in-place op would make it: ``output`` is never allocated and
    ``source`` lives until ``output``'s free (brute force over the rows)."""
    edited = []
    for row in events:
        action, sid = row[0], row[1]
        if sid == output and action == "alloc":
            continue
        if sid == source and action == "free":
            continue
        if sid == output and action == "free":
            row = ("free", source) + row[2:]
        edited.append(row)
    sizes = {r[1]: r[2] for r in events if r[0] == "alloc"}
    return int(np.cumsum([sizes[r[1]] * (1 if r[0] == "alloc" else -1) for r in edited]).max())


@pytest.fixture(scope="module")
def advice(tmp_path_factory):
    path = write_events(tmp_path_factory.mktemp("inplace") / "t.trace", EVENTS)
    trace, base = load(path)
    return trace, collect(trace, base, hardware(None, "cpu"), providers=[inplace_advice])


def by_line(items, line):
    return [a for a in items if a.location.endswith(f":{line}")]


def test_the_relu_whose_input_dies_is_suggested_with_its_peak_drop(advice):
    trace, items = advice
    relu, = by_line(items, 11)
    assert relu.status == SUGGESTED and relu.kind == "inplace"
    assert "inplace=True" in relu.title
    assert relu.location == "/work/model.py:11"
    baseline = int(live_bytes(trace.events).max())
    assert baseline == 20 * KB  # P, Q, x, a, b and the scratch
    # the drop is down to the next highest moment, the backward's 18.1 KB (not 4 KB)
    assert relu.bytes_saved == baseline - peak_after_inplace(EVENTS, 5, 4) == 1900
    assert relu.details["transient_bytes"] == 4 * KB


@pytest.mark.parametrize("line, reason", [
    (12, "saved it for backward"),  # gelu's input lives into the backward
    (13, "a parameter"),  # a leaf that requires grad
    (14, "outlives the step"),  # the batch the loop holds
])
def test_changes_that_would_break_autograd_or_the_script_are_refused(advice, line, reason):
    _, items = advice
    item, = by_line(items, line)
    assert item.status == REFUSED and item.bytes_saved == 0
    assert reason in item.reason


def test_ops_without_an_in_place_form_are_not_mentioned(advice):
    _, items = advice
    assert not by_line(items, 10) and not by_line(items, 15)


def test_a_trace_without_data_flow_says_in_place_ops_were_not_examined(tmp_path):
    events = [r[:6] + ([],) + r[7:] for r in EVENTS]
    trace, base = load(write_events(tmp_path / "old.trace", events))
    missing, = collect(trace, base, hardware(None, "cpu"), providers=[inplace_advice])
    assert missing.status == MISSING and "data flow" in missing.reason


def test_two_changes_needed_together_are_counted_together(tmp_path):
    # h = x * 2; h = h - 1; h = relu(h): both moments hold two big tensors; only both in
    # place lower the peak (the demo benchmarks/inplace_advice.py measures)
    events = [
        ("alloc", 1, 1 * KB, "parameter", "aten::empty", O, [], 0),
        ("alloc", 2, 8 * KB, "input", "aten::randn", O, [], 5),
        ("alloc", 3, 8 * KB, "temporary", "aten::mul", F, [2], 12),
        ("alloc", 4, 8 * KB, "temporary", "aten::sub", F, [3], 13),
        ("free", 3, 0, "", "", F, [], 0),
        ("alloc", 5, 8 * KB, "activation", "aten::relu", F, [4], 14),
        ("free", 4, 0, "", "", F, [], 0),
        ("alloc", 6, 1 * KB, "activation", "aten::addmm", F, [5, 1], 15),
        ("alloc", 7, 1 * KB, "gradient", "aten::mm", B, [6, 5], 16),
        ("free", 5, 0, "", "", B, [], 0),
        ("free", 6, 0, "", "", B, [], 0),
    ]
    trace, base = load(write_events(tmp_path / "chain.trace", events))
    items = collect(trace, base, hardware(None, "cpu"), providers=[inplace_advice])
    sub, = by_line(items, 13)
    relu, = by_line(items, 14)
    assert sub.bytes_saved == relu.bytes_saved == 0  # alone, the other moment stays
    together, = [a for a in items if not a.location]
    # before: P + x + two 8 KB = 25 KB at both moments; all in place the backward's
    # P + x + h + out + grad = 19 KB is the peak
    assert together.bytes_saved == 25 * KB - 19 * KB
    assert sub.status == relu.status == SUGGESTED


def test_an_input_that_dies_only_after_later_ops_is_refused(tmp_path):
    # y = relu(a); z = y * 3 ...; a is freed after z's op ran: the script held it, and an
    # in-place op (allocating nothing, so unseen) might have read it in between
    events = [
        ("alloc", 1, 4 * KB, "input", "aten::randn", O, [], 5),
        ("alloc", 2, 4 * KB, "activation", "aten::exp", F, [1], 10),
        ("alloc", 3, 4 * KB, "activation", "aten::relu", F, [2], 11),
        ("alloc", 4, 4 * KB, "activation", "aten::mul", F, [3], 12),
        ("free", 2, 0, "", "", F, [], 0),
        ("alloc", 5, 100, "gradient", "aten::mul", B, [4], 13),
        ("free", 3, 0, "", "", B, [], 0),
        ("free", 4, 0, "", "", B, [], 0),
    ]
    trace, base = load(write_events(tmp_path / "later.trace", events))
    items = collect(trace, base, hardware(None, "cpu"), providers=[inplace_advice])
    relu, = by_line(items, 11)
    assert relu.status == REFUSED and "later ops" in relu.reason
