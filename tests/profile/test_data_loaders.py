"""The DataLoaders a script iterates, recorded in the trace's ``data_loaders`` metadata:
settings, the line that made the loader, per step the wait in ``__next__``, batch and copy
bytes (non_blocking, pinned), and the workers' memory -- on both engines (conftest)."""
from __future__ import annotations

import textwrap

import pytest
import torch
from torch.utils.data import DataLoader
from torch.utils.data import dataloader as _dataloader

from memadvisor.profile import profile_script
from memadvisor.trace import read_trace

SCRIPT = textwrap.dedent("""\
    import sys, torch
    from torch.utils.data import DataLoader, TensorDataset
    workers, pin = int(sys.argv[1]), sys.argv[2] == "pin"
    data = TensorDataset(torch.randn(48, 3, 4, 4), torch.randint(0, 10, (48,)))
    loader = DataLoader(data, batch_size=8, num_workers=workers, pin_memory=pin)  # line 5
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in loader:
        x, y = x.to("cpu", non_blocking=True), y.to("cpu")  # line 9
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
""")
IMAGES = 8 * 3 * 4 * 4 * 4  # one batch of float32 images
LABELS = 8 * 8  # int64


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("loaders")
    (path / "train.py").write_text(SCRIPT)
    return path


def _profile(folder, workers: int, pin: bool, name: str):
    out = folder / f"{name}.trace"
    result = profile_script(folder / "train.py", [str(workers), "pin" if pin else "no"],
                            out, steps=3, probes=False)
    assert result.status == "completed", result.error
    return read_trace(out)


@pytest.mark.parametrize("workers,pin", [(0, False), (2, True)])
def test_each_loader_is_recorded_with_its_settings_waits_and_copies(folder, engine, workers,
                                                                   pin):
    trace = _profile(folder, workers, pin, f"{engine}-{workers}-{pin}")
    loader, = trace.meta.data_loaders
    assert loader["source"] == f"{folder / 'train.py'}:5"
    assert (loader["num_workers"], loader["batch_size"]) == (workers, 8)
    assert loader["prefetch_factor"] == (2 if workers else None)
    assert loader["pin_memory"] is pin
    # torch pins only where an accelerator is present: what was asked is kept beside it
    assert loader["pin_memory_used"] is (pin and torch.accelerator.is_available())
    assert ("pinning" in loader) is (pin and not torch.accelerator.is_available())
    assert loader["batches"] == 3
    assert loader["batch_bytes"] == IMAGES + LABELS
    # one batch per step, each waited for (recorded and > 0: no timing asserted)
    assert [s["index"] for s in loader["steps"]] == [0, 1, 2]
    for step in loader["steps"]:
        assert step["batches"] == 1 and step["wait_s"] > 0
        assert step["batch_bytes"] == IMAGES + LABELS
        assert step["copy_bytes"] == IMAGES + LABELS
        assert step["non_blocking_copy_bytes"] == IMAGES  # the labels' copy blocks
        assert step["pinned_copy_bytes"] == (IMAGES + LABELS if loader["pin_memory_used"]
                                             else 0)
    sites = {(c["non_blocking"], c["bytes"]) for c in loader["copies"]}
    assert sites == {(True, 3 * IMAGES), (False, 3 * LABELS)}
    assert all(c["source"] == f"{folder / 'train.py'}:9" and c["from_batch"]
               and c["device"] == "cpu" and c["calls"] == 3 for c in loader["copies"])
    assert loader["cpu_count"] >= 1 and loader["host_memory_bytes"] > 0
    if workers:
        memory = loader["workers_memory"]
        assert memory["samples"] >= 1 and memory["method"] in ("psutil", "proc_status")
        assert len(memory["max_rss_bytes"]) == workers
        assert memory["max_total_rss_bytes"] > 0
    else:
        assert "workers_memory" not in loader
    # the advice reads it: the analysed step's wait, with the loader's line
    from memadvisor.advice import collect
    from memadvisor.advice.data_loading import data_loading_advice
    from memadvisor.simulate import hardware, prepare
    items = collect(trace, prepare(trace), hardware(None, "cpu"),
                    providers=[data_loading_advice])
    # which advice it is depends on the wait's share of the step, a timing (the INFO
    # "waits for its batch" or, on a slow machine, a num_workers suggestion): either holds it
    wait, = [a for a in items if "share_of_step" in a.details]
    if wait.status == "info":
        assert "waits for its batch" in wait.title
    else:
        assert wait.status == "suggested" and wait.title.startswith("DataLoader(num_workers=")
    assert wait.seconds == loader["steps"][-1]["wait_s"] > 0
    assert wait.location == loader["source"]
    memory, = [a for a in items if "host memory" in a.title]
    assert memory.details["batches_in_flight"] == (2 * 2 + 1 if workers else 1)


def test_a_script_without_a_data_loader_records_none(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text(textwrap.dedent("""\
        import torch
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(5):
            x = torch.randn(8, 4)
            model(x).sum().backward()
            opt.step()
    """))
    profile_script(script, [], tmp_path / "t.trace", steps=2, probes=False)
    assert read_trace(tmp_path / "t.trace").meta.data_loaders == []


def test_the_session_leaves_torch_as_it_found_it(folder, engine):
    before = (DataLoader.__init__, DataLoader.__iter__, _dataloader._BaseDataLoaderIter.__next__)
    _profile(folder, 0, False, f"{engine}-restore")
    assert (DataLoader.__init__, DataLoader.__iter__,
            _dataloader._BaseDataLoaderIter.__next__) == before
    # the copy wrappers live only between a batch and the forward: none left behind
    assert not {"to", "cuda", "copy_"} & set(torch.Tensor.__dict__)


@pytest.mark.parametrize("reader", ["psutil", "proc_status"])
def test_worker_memory_is_read_with_psutil_or_from_proc(monkeypatch, reader):
    import os
    import types
    from memadvisor.profile import worker_memory
    if reader == "proc_status":
        monkeypatch.setattr(worker_memory, "_psutil", None)
    elif worker_memory._psutil is None:
        pytest.skip("psutil is not installed")
    memory = worker_memory.WorkerMemory()
    # this process stands for a worker: its figures are real, and ordered
    iterator = types.SimpleNamespace(_workers=[types.SimpleNamespace(pid=os.getpid())])
    memory.sample(iterator, 0)
    memory.sample(iterator, 1)  # within 10 ms of the first: not read again
    described = memory.describe()
    assert described["method"] == reader and described["samples"] == 1
    rss, = described["max_rss_bytes"]
    anonymous, = described["max_anonymous_bytes"]
    assert rss >= anonymous > 0
    private, = described["max_private_bytes"]
    assert 0 < private <= rss


@pytest.mark.parametrize("wait_s,workers,cpus,status,title", [
    (0.001, 0, 4, "info", "input pipeline: the step waits for its batch"),
    (0.05, 0, 4, "suggested", "DataLoader(num_workers=2)"),
    (0.05, 2, 8, "suggested", "DataLoader(num_workers=4) instead of 2"),
    (0.05, 4, 4, "info", "input pipeline: the step waits for its batch"),  # workers = CPUs
])
def test_the_wait_advice_follows_the_waits_share_of_the_step(wait_s, workers, cpus, status,
                                                             title):
    from memadvisor.advice.loader_pipeline import loader_wait_advice
    loader = {"num_workers": workers, "cpu_count": cpus, "source": "train.py:5"}
    item = loader_wait_advice(loader, {"batches": 1, "wait_s": wait_s}, step_seconds=0.1)
    assert (item.status, item.title) == (status, title)
    assert item.details["share_of_step"] == pytest.approx(wait_s / 0.1)
