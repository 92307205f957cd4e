"""Data-loading advice from the recorded DataLoaders (``meta.data_loaders``): the step's wait
for its batch, the batches in flight and the workers' memory, and pin_memory/non_blocking
only where the script does not already do them."""
import pytest

from memadvisor.advice import INFO, MISSING, SUGGESTED, collect
from memadvisor.advice.data_loading import data_loading_advice
from memadvisor.advice.loader_pipeline import in_flight
from memadvisor.simulate import hardware
from memadvisor.trace import TraceError, read_trace, write_trace

from .test_data_loading import loader_trace
from .traces import load, write_events

MiB, GiB = 1 << 20, 1 << 30
BATCH = 8 * MiB + 512  # the loader_trace's images and labels


def loader(**changes) -> dict:
    """A loader as the profiler records it: 2 workers, prefetch 2, no pinning; the
    analysed step (0, 10 ms) waited 0.2 ms and copied the batch blocking."""
    entry = {"class": "DataLoader", "num_workers": 2, "prefetch_factor": 2,
             "pin_memory": False, "pin_memory_used": False, "persistent_workers": False,
             "batch_size": 64, "drop_last": False, "source": "/work/model.py:12",
             "function": "main", "batches": 3, "wait_s": 0.0006, "batch_bytes": BATCH,
             "batch_pinned_bytes": 0, "cpu_count": 8, "host_memory_bytes": 64 * GiB,
             "steps": [{"index": 0, "batches": 1, "wait_s": 0.0002, "batch_bytes": BATCH,
                        "copy_bytes": BATCH, "non_blocking_copy_bytes": 0,
                        "pinned_copy_bytes": 0}],
             "copies": [{"source": "/work/model.py:20", "device": "cuda:0",
                         "non_blocking": False, "source_pinned": False, "from_batch": True,
                         "calls": 1, "bytes": BATCH}],
             "workers_memory": {"method": "psutil", "samples": 4, "private_samples": 1,
                                "max_rss_bytes": [300 * MiB] * 2,
                                "max_anonymous_bytes": [250 * MiB] * 2,
                                "max_private_bytes": [40 * MiB] * 2,
                                "max_total_rss_bytes": 600 * MiB,
                                "max_total_anonymous_bytes": 500 * MiB,
                                "max_total_private_bytes": 80 * MiB}}
    step = changes.pop("step", {})
    entry.update(changes)
    entry["steps"][0].update(step)
    if entry["workers_memory"] is None:  # no workers: the profiler records none
        del entry["workers_memory"]
    return entry


def advice_for(tmp_path, loaders, gpu="h100-80gb"):
    path = loader_trace(tmp_path / "t.trace")
    trace = read_trace(path)
    trace.meta.data_loaders = loaders
    write_trace(path, trace.events, trace.meta)
    trace, base = load(path)
    target = hardware(gpu) if gpu else hardware(None, "cpu")
    return collect(trace, base, target, providers=[data_loading_advice])


def titled(items, text):
    return [a for a in items if text in a.title]


def test_a_long_wait_for_the_batch_suggests_workers_with_the_measured_time(tmp_path):
    items = advice_for(tmp_path, [loader(num_workers=0, prefetch_factor=None,
                                         workers_memory=None, step={"wait_s": 0.004})])
    workers, = titled(items, "num_workers=")
    assert workers.status == SUGGESTED and workers.title == "DataLoader(num_workers=2)"
    assert workers.seconds == pytest.approx(0.004)  # 4 of the 10 ms step
    assert workers.details["share_of_step"] == pytest.approx(0.4)
    assert workers.location == "/work/model.py:12"  # the line that made the loader
    assert "4.00 ms" in workers.reason and "40%" in workers.reason
    # the recorded wait replaces the older 'input side' estimate, and nothing is missing
    assert not titled(items, "input side") and not [a for a in items if a.status == MISSING]


def test_more_workers_are_doubled_up_to_the_cpus_and_not_past_them(tmp_path):
    items = advice_for(tmp_path, [loader(num_workers=3, step={"wait_s": 0.002})])
    assert titled(items, "num_workers=")[0].title == "DataLoader(num_workers=6) instead of 3"
    items = advice_for(tmp_path, [loader(num_workers=8, step={"wait_s": 0.002})])
    wait, = titled(items, "waits for its batch")
    assert wait.status == INFO and "8 CPUs" in wait.reason
    assert not titled(items, "num_workers=")


def test_a_short_wait_is_a_figure_not_a_change(tmp_path):
    wait, = titled(advice_for(tmp_path, [loader()]), "waits for its batch")
    assert wait.status == INFO and wait.seconds == pytest.approx(0.0002)


def test_the_batches_in_flight_and_the_workers_memory_are_counted(tmp_path):
    flight = in_flight(loader(pin_memory_used=True))
    assert flight["batches_in_flight"] == 5  # 2 workers x prefetch 2 + 1
    assert flight["pipeline_host_bytes"] == flight["pinned_host_bytes"] == 5 * BATCH
    assert in_flight(loader(num_workers=0))["batches_in_flight"] == 1  # no prefetch
    memory, = titled(advice_for(tmp_path, [loader()]), "host memory")
    assert memory.status == INFO
    # 5 batches plus the workers' private (USS) bytes, not their resident ones
    assert memory.details["pipeline_and_workers_host_bytes"] == 5 * BATCH + 80 * MiB
    assert "private (USS)" in memory.reason


def test_large_pipeline_memory_while_the_workers_are_ahead_suggests_less_prefetch(tmp_path):
    # 4 workers x prefetch 4 of a 1 GiB batch, on a 64 GiB machine, no wait
    big = loader(num_workers=4, prefetch_factor=4, batch_bytes=GiB)
    memory, = titled(advice_for(tmp_path, [big]), "host memory")
    assert memory.status == SUGGESTED
    assert memory.title.startswith("DataLoader(prefetch_factor=1) instead of 4")
    assert memory.details["host_bytes_saved"] == 4 * 3 * GiB  # 3 batches fewer per worker
    # 2 workers fewer: their 4 batches each and their share of the 80 MiB private bytes
    assert memory.details["fewer_workers_save_bytes"] == 2 * (4 * GiB + 20 * MiB)
    # the same loader while the step waits for it: nothing to take away
    slow = loader(num_workers=4, prefetch_factor=4, batch_bytes=GiB, step={"wait_s": 0.003})
    memory, = titled(advice_for(tmp_path, [slow]), "host memory")
    assert memory.status == INFO


@pytest.mark.parametrize("done,title", [
    ({}, "DataLoader(pin_memory=True) and .to(device, non_blocking=True)"),
    ({"pin_memory": True}, ".to(device, non_blocking=True) for the batch"),
    ({"step": {"non_blocking_copy_bytes": BATCH}}, "DataLoader(pin_memory=True)"),
])
def test_pinning_and_non_blocking_are_suggested_only_where_not_done(tmp_path, done, title):
    items = advice_for(tmp_path, [loader(**done)])
    copy, = [a for a in items if "non_blocking" in a.title or "pin_memory" in a.title]
    assert copy.status == SUGGESTED and copy.title == title
    assert copy.seconds == pytest.approx(BATCH / 64e9)


def test_a_script_that_pins_and_copies_non_blocking_is_told_so(tmp_path):
    # pin_memory=True asked (done or not on the profiling machine) and the copy overlapped
    items = advice_for(tmp_path, [loader(pin_memory=True, step={
        "non_blocking_copy_bytes": BATCH - 512})])  # the labels' 512 B copy blocks: nothing
    assert not [a for a in items if a.status == SUGGESTED and "pin" in a.title]
    already, = titled(items, "already pinned and non_blocking")
    assert already.status == INFO


def test_an_older_trace_says_what_it_lacks_and_a_loaderless_one_does_not(tmp_path):
    missing = [a for a in advice_for(tmp_path, None) if a.status == MISSING]
    assert len(missing) == 1 and "profile again" in missing[0].reason
    assert not [a for a in advice_for(tmp_path, []) if a.status == MISSING]


def test_damaged_loader_metadata_is_refused_in_one_line(tmp_path):
    path = loader_trace(tmp_path / "t.trace")
    trace = read_trace(path)
    trace.meta.data_loaders = [loader(step={"wait_s": -1.0})]
    write_trace(path, trace.events, trace.meta)
    with pytest.raises(TraceError, match="data_loaders"):
        read_trace(path)


def test_a_cpu_trace_judged_for_a_gpu_weighs_the_wait_against_the_gpu_step(tmp_path):
    # measured on the CPU: a 0.2 ms wait in a 10 ms step (2%) is nothing there, but the
    # GPU's modelled step is shorter than the wait: the wait is host work that stays
    rows = [("alloc", 1, MiB, "input", "aten::stack", "other", [], 30),
            ("alloc", 2, MiB, "activation", "aten::addmm", "forward", [1], 21),
            ("free", 2, 0, "", "", "backward", [], 0)]
    path = write_events(tmp_path / "cpu.trace", rows, step_seconds=0.010)
    trace = read_trace(path)
    trace.meta.data_loaders = [loader()]
    # 100 forward ops per step, too few FLOPs to count: the GPU step is their launches
    trace.meta.op_stats = [{"module": "", "phase": "forward", "op": "aten::addmm",
                            "calls": 100, "flops": 0}]
    write_trace(path, trace.events, trace.meta)
    trace, base = load(path)
    on_cpu, = titled(collect(trace, base, hardware(None, "cpu"),
                             providers=[data_loading_advice]), "waits for its batch")
    assert on_cpu.status == INFO and "target_step_seconds" not in on_cpu.details
    on_gpu, = titled(collect(trace, base, hardware("h100-80gb"),
                             providers=[data_loading_advice]), "num_workers=")
    assert on_gpu.status == SUGGESTED and on_gpu.title == "DataLoader(num_workers=4) instead of 2"
    assert on_gpu.details["target_step_seconds"] == pytest.approx(100 * 5e-6)
    assert on_gpu.details["share_of_target_step"] == pytest.approx(0.2 / 0.7)
    assert "h100-80gb" in on_gpu.reason and "(modelled" in on_gpu.reason
