"""Small traces written event by event for the advice tests (no torch, no profiling)."""
from __future__ import annotations

from memadvisor.trace import TraceMeta, events_table, write_trace
from memadvisor.trace.io import read_trace


def write_events(path, rows: list[tuple], device: str = "cpu", steps: int = 1,
                 step_seconds: float = 0.1, step_of=None, time_of=None,
                 step_start_ns: int = 0) -> str:
    """``rows``: (action, storage id, bytes, category, op, phase, input ids, source line)
    or the same with a device after the line; an alloc's free repeats its columns."""
    alive = {}
    columns = {name: [] for name in ("action", "storage_id", "size_bytes", "category", "op",
                                     "phase", "input_ids", "source_line", "device")}
    for row in rows:
        action, sid, size, category, op, phase, inputs, line, *where = row
        if action == "free":
            size, category, op, line, where = alive[sid]
            inputs = []
        else:
            alive[sid] = (size, category, op, line, where)
        for name, value in zip(columns, (action, sid, size, category, op, phase, list(inputs),
                                         line, where[0] if where else device)):
            columns[name].append(value)
    count = len(rows)
    columns.update(
        seq=list(range(count)),
        time_ns=[time_of(i) if time_of else i * 1000 for i in range(count)],
        dtype=["float32"] * count, shape=[""] * count, module=[""] * count,
        step=[step_of(i) if step_of else 0 for i in range(count)],
        source_file=["/work/model.py" if line else "" for line in columns["source_line"]],
        source_function=["forward"] * count)
    meta = TraceMeta(device=device, steps_requested=steps, steps_completed=steps,
                     step_detection="optimizer", cwd="/work",
                     steps=[{"index": s, "start_ns": step_start_ns, "end_ns": 0,
                             "duration_s": step_seconds, "peak_bytes": 0}
                            for s in range(steps)])
    write_trace(path, events_table(columns), meta)
    return str(path)


def load(path):
    from memadvisor.simulate import prepare
    trace = read_trace(path)
    return trace, prepare(trace)
