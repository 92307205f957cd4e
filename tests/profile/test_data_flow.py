"""The trace's data flow (``input_ids``): each op output's alloc row names the storages its
op read, so that a reader can follow a dtype from the tensors an op read to the one it
made.  Both engines (conftest runs every test with each)."""
from __future__ import annotations

import torch
import torch.nn as nn

from memadvisor.profile import ProfileSession


def _rows(table):
    events = table.to_pandas()
    return events[(events["action"] == "alloc") & (events["dtype"] != "bytes")]


def _sid_of(events, op: str, shape: str) -> list[int]:
    hit = events[(events["op"] == op) & (events["shape"] == shape)]
    return hit["storage_id"].tolist()


def test_an_ops_output_names_the_storages_it_read():
    with ProfileSession() as session:
        a = torch.randn(16, 8)
        b = torch.randn(16, 8)
        total = a + b  # noqa: F841 (kept alive: its row is what is read)
        scaled = torch.mm(a, b.t())  # reads a and b through views (a transpose)
        del scaled
    events = _rows(session.build()[0])
    (a_sid, b_sid) = _sid_of(events, "aten::randn", "16,8")
    add = events[events["op"] == "aten::add"]
    assert len(add) == 1
    assert sorted(add["input_ids"].iloc[0]) == sorted([a_sid, b_sid])
    mm = events[events["op"] == "aten::mm"]
    assert sorted(mm["input_ids"].iloc[0]) == sorted([a_sid, b_sid])
    # a factory reads nothing
    assert all(len(ids) == 0 for ids in events[events["op"] == "aten::randn"]["input_ids"])


def test_a_models_chain_links_each_output_to_the_one_before():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    with ProfileSession() as session:
        x = torch.randn(4, 8)
        model(x).sum().backward()
    table, _meta = session.build()
    known = set(table.column("storage_id").to_pylist())
    events = _rows(table)
    forward = events[events["phase"] == "forward"]
    relu = forward[forward["op"] == "aten::relu"]
    first_linear = forward[(forward["op"] == "aten::addmm") & (forward["shape"] == "4,8")]
    assert len(relu) == 1 and len(first_linear) == 1
    # relu read the first linear's output; the second linear read relu's
    assert list(relu["input_ids"].iloc[0]) == [first_linear["storage_id"].iloc[0]]
    second = forward[(forward["op"] == "aten::addmm") & (forward["shape"] == "4,4")]
    assert relu["storage_id"].iloc[0] in list(second["input_ids"].iloc[0])
    # and every id named is a storage of the trace (the parameters too: logged when read)
    named = {int(sid) for ids in events["input_ids"] for sid in ids}
    assert named and named <= known
