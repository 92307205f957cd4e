"""Baselines with rows of storages resized in place (``UntypedStorage.resize_``: a free of the
old size and an alloc of the new one, zero-size ones included, the byte count as shape; what
a trace profiled under FSDP2 holds) and kernels' raw ``bytes`` blocks: every plan is
predicted without error and a resized storage is never scaled with the batch by its
"shape"."""
import numpy as np
import pandas as pd
import pytest

from memadvisor.plan import Plan, PlanError
from memadvisor.simulate import hardware, prepare, simulate
from memadvisor.simulate.search import advise
from memadvisor.trace.analysis import analysed_step, step_slice
from memadvisor.trace.io import Trace

RESIZE = "UntypedStorage.resize_"


def _with_resized_storages(trace) -> Trace:
    events = trace.events
    window = step_slice(events, analysed_step(trace))
    step = events.iloc[window]
    forward = step.index[(step["phase"] == "forward") & (step["action"] == "alloc")]
    backward = step.index[(step["phase"] == "backward") & (step["action"] == "alloc")]
    first, last = int(forward[0]), int(backward[-1])
    template = events.loc[first]
    sid = int(events["storage_id"].max()) + 1
    # 256 bytes: the batch's 8 x 32 tokens, a first "dimension" the shape rule would scale
    rows = [  # (after row, action, sid, size, dtype, shape, category, phase)
        (first, "alloc", sid, 256, "float32", "256", "activation", "forward"),
        (last, "free", sid, 256, "float32", "256", "activation", "backward"),
        (last, "alloc", sid + 1, 0, "float32", "0", "activation", "backward"),
        (first, "alloc", sid + 3, 0, "float32", "0", "temporary", "forward"),
        (first, "alloc", sid + 2, 4096, "bytes", "4096", "temporary", "forward"),
        (first + 1, "free", sid + 2, 4096, "bytes", "4096", "temporary", "forward"),
    ]
    new = []
    for after, action, storage, size, dtype, shape, category, phase in rows:
        row = template.copy()
        row.update({"action": action, "storage_id": storage, "size_bytes": size,
                    "dtype": dtype, "shape": shape, "category": category, "phase": phase,
                    "op": RESIZE if dtype != "bytes" else "aten::mm"})
        new.append((after + 0.5, row))
    frame = pd.concat([events.astype(object), pd.DataFrame([r for _, r in new]).astype(object)])
    frame.index = list(events.index) + [k for k, _ in new]
    frame = frame.sort_index(kind="stable").reset_index(drop=True)
    frame["seq"] = np.arange(len(frame), dtype=np.int64)
    for name in ("seq", "time_ns", "storage_id", "size_bytes"):
        frame[name] = frame[name].astype(np.int64)
    for name in ("step", "source_line"):
        frame[name] = frame[name].astype(np.int32)
    for name in events.columns:
        if isinstance(events[name].dtype, pd.CategoricalDtype):
            frame[name] = frame[name].astype(str).astype("category")
    return Trace(frame, trace.meta)


@pytest.fixture(scope="module")
def resized_base(baseline_trace):
    return prepare(_with_resized_storages(baseline_trace))


def test_resized_storage_is_not_scaled_by_its_byte_count(resized_base):
    timeline = resized_base.timeline
    resized = timeline.op_in((RESIZE,))
    assert resized.sum() == 3  # the 256-byte storage and the zero-size ones
    assert not timeline.scales_with_batch[resized].any()


@pytest.mark.parametrize("spec", [
    "checkpoint=Block", "accum=2", "precision=amp-bf16", "precision=bf16",
    "optimizer=sgd-momentum", "optimizer=adafactor", "shard=zero3,world=2",
    "shard=zero2,world=4,hybrid=2", "precision=amp-bf16,checkpoint=Block,accum=2"])
def test_every_plan_is_predicted(resized_base, spec):
    try:
        prediction = simulate(resized_base, Plan.parse(spec))
    except PlanError:
        pytest.skip("not a plan for this trace")
    assert prediction.peak_bytes > 0


def test_advise_runs(resized_base):
    from memadvisor.simulate.hardware import cublas_workspace_bytes
    h100 = hardware("h100")
    # the two cuBLAS workspaces (32 MiB each on an H100) come on top of the tiny model
    result = advise(resized_base, h100, 8 * resized_base.peak.bytes
                    + 2 * cublas_workspace_bytes(h100), 2)
    assert result.ranked
