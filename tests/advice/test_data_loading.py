"""Data-loading advice: the batch's copy to the GPU (bytes, source line, seconds at the
target's host link), the time before the forward, and what the trace cannot say."""
import pytest

from memadvisor.advice import INFO, MISSING, SUGGESTED, collect
from memadvisor.advice.data_loading import data_loading_advice
from memadvisor.simulate import hardware

from .traces import load, write_events

MiB = 1 << 20
O, F, B = "other", "forward", "backward"


def loader_trace(path):
    # per step: the DataLoader's host batch (8 MiB), its copy to the GPU at line 20, the
    # forward from the 6th event on (event i at i + 1 ms)
    # as the profiler records a DataLoader's: the collated host batch is 'other' (only its
    # copy is fed to the model), the labels' copy an activation (the loss saves it)
    rows = [
        ("alloc", 1, 1 * MiB, "parameter", "aten::empty", O, [], 0, "cuda:0"),
        ("alloc", 2, 8 * MiB, "other", "aten::stack", O, [], 30, "cpu"),
        ("alloc", 6, 512, "other", "aten::stack", O, [], 30, "cpu"),
        ("alloc", 3, 8 * MiB, "input", "aten::_to_copy", O, [2], 20, "cuda:0"),
        ("alloc", 7, 512, "activation", "aten::_to_copy", O, [6], 20, "cuda:0"),
        ("alloc", 4, 4 * MiB, "activation", "aten::addmm", F, [3, 1], 21, "cuda:0"),
        ("alloc", 5, 1 * MiB, "gradient", "aten::mm", B, [4, 7], 22, "cuda:0"),
        ("free", 4, 0, "", "", B, [], 0),
    ]
    # the step's recorded start (0) is before the first event: the profiler's own work
    return write_events(path, rows, device="cuda:0", step_seconds=0.010,
                        time_of=lambda i: (i + 1) * 1_000_000)


@pytest.fixture(scope="module")
def items(tmp_path_factory):
    trace, base = load(loader_trace(tmp_path_factory.mktemp("loader") / "t.trace"))
    return collect(trace, base, hardware("h100-80gb"), providers=[data_loading_advice])


def test_the_copy_to_the_gpu_is_named_with_its_bytes_and_time(items):
    copy, = [a for a in items if "pin_memory" in a.title]
    assert copy.status == SUGGESTED
    assert copy.location == "/work/model.py:20"
    assert copy.details["copy_bytes"] == 8 * MiB + 512  # images and labels
    # the host storages the copies read (data flow), though neither is an 'input'
    assert copy.details["pinned_bytes_per_batch"] == 8 * MiB + 512
    assert copy.seconds == pytest.approx((8 * MiB + 512) / 64e9)  # the H100's host link


def test_the_input_side_of_the_step_is_measured(items):
    before, = [a for a in items if "input side" in a.title]
    # the step's first event at 1 ms, its first forward event (the 6th) at 6 ms: 5 of 10 ms
    assert before.seconds == pytest.approx(0.005)
    assert before.details["share_of_step"] == pytest.approx(0.5)
    assert before.status == INFO  # a figure, no change implied
    assert "workers" in before.reason  # over a tenth of the step


def test_what_the_trace_does_not_record_is_said(items):
    missing, = [a for a in items if a.status == MISSING]
    assert "pinned" in missing.reason and "num_workers" in missing.reason


def test_a_batch_made_once_before_the_loop_gives_no_data_loading_advice(tmp_path):
    rows = [
        ("alloc", 2, 8 * MiB, "input", "aten::randn", O, [], 30),
        ("alloc", 4, 4 * MiB, "activation", "aten::addmm", F, [2], 21),
        ("free", 4, 0, "", "", B, [], 0),
    ]
    # two steps; the batch is made in step 0, the analysed step 1 only reads it
    again = [("alloc", 5, 4 * MiB, "activation", "aten::addmm", F, [2], 21),
             ("free", 5, 0, "", "", B, [], 0)]
    trace, base = load(write_events(tmp_path / "fixed.trace", rows + again, steps=2,
                                    step_of=lambda i: 0 if i < 3 else 1))
    assert collect(trace, base, hardware(None, "cpu"), providers=[data_loading_advice]) == []
