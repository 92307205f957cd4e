"""Allocator-setting advice on a GPU target: advised where the allocator model's replay
shows fragmentation that the setting removes, with the reserved bytes it saves."""
from memadvisor.advice import SUGGESTED, collect
from memadvisor.advice.allocator_settings import allocator_settings_advice
from memadvisor.simulate import hardware

from .traces import load, write_events

MiB = 1 << 20
F = "forward"  # (gelu, not a matmul: no cuBLAS workspace joins the stream)


def fragmenting_trace(path):
    # a 30 MiB block freed cannot hold the 32 MiB request after it, nor the 12 MiB one's
    # hole the 40 MiB one: four segments, 114 MiB reserved for a 72 MiB peak
    return write_events(path, [
        ("alloc", 1, 30 * MiB, "activation", "aten::gelu", F, [], 10),
        ("alloc", 2, 12 * MiB, "activation", "aten::gelu", F, [], 11),
        ("free", 1, 0, "", "", F, [], 0),
        ("alloc", 3, 32 * MiB, "activation", "aten::gelu", F, [], 12),
        ("free", 2, 0, "", "", F, [], 0),
        ("alloc", 4, 40 * MiB, "activation", "aten::gelu", F, [], 13),
        ("free", 3, 0, "", "", F, [], 0),
        ("free", 4, 0, "", "", F, [], 0),
    ], device="cuda:0")


def test_expandable_segments_is_advised_with_the_reserved_bytes_it_saves(tmp_path):
    trace, base = load(fragmenting_trace(tmp_path / "frag.trace"))
    items = collect(trace, base, hardware("h100-80gb"), providers=[allocator_settings_advice])
    expandable, = [a for a in items if "expandable_segments" in a.title]
    assert expandable.status == SUGGESTED
    assert expandable.details["reserved_bytes_default"] == (30 + 12 + 32 + 40) * MiB
    assert expandable.details["allocated_peak_bytes"] == 72 * MiB
    # one growing large segment mapped in 20 MiB pages: 72 MiB -> 80 MiB
    assert expandable.details["reserved_bytes"] == 80 * MiB
    assert expandable.bytes_saved == (114 - 80) * MiB
    assert expandable.details["alloc_conf"] == "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    # a limit between the median request and the largest changes nothing here: not advised
    assert not [a for a in items if "max_split_size_mb" in a.title and a.status == SUGGESTED]


def test_nothing_is_advised_on_the_cpu_target_or_without_fragmentation(tmp_path):
    trace, base = load(fragmenting_trace(tmp_path / "frag.trace"))
    assert collect(trace, base, hardware(None, "cpu"),
                   providers=[allocator_settings_advice]) == []
    trace, base = load(write_events(tmp_path / "tidy.trace", [
        ("alloc", 1, 30 * MiB, "activation", "aten::gelu", F, [], 10),
        ("free", 1, 0, "", "", F, [], 0),
        ("alloc", 2, 30 * MiB, "activation", "aten::gelu", F, [], 11),
        ("free", 2, 0, "", "", F, [], 0),
    ], device="cuda:0"))
    assert collect(trace, base, hardware("h100-80gb"),
                   providers=[allocator_settings_advice]) == []


def test_max_split_size_is_advised_where_it_saves(tmp_path):
    # 100 MiB segments made by the big requests are split by the 40 MiB ones and stay
    # split (the 40 MiB block lives on): each new big request needs a new segment
    rows, sid = [], 0
    keep = []
    for index in range(4):
        sid += 1
        big = sid
        rows.append(("alloc", big, 100 * MiB, "activation", "aten::gelu", F, [], 10))
        rows.append(("free", big, 0, "", "", F, [], 0))
        sid += 1
        rows.append(("alloc", sid, 40 * MiB, "activation", "aten::gelu", F, [], 11))
        keep.append(sid)
    rows += [("free", s, 0, "", "", F, [], 0) for s in keep]
    trace, base = load(write_events(tmp_path / "split.trace", rows, device="cuda:0"))
    items = collect(trace, base, hardware("h100-80gb"), providers=[allocator_settings_advice])
    split, = [a for a in items if "max_split_size_mb" in a.title]
    assert split.status == SUGGESTED
    # default: three 100 MiB segments (each 40 MiB block splits one and stays); over the
    # limit the 40 MiB requests get their own segments and one 100 MiB segment serves
    # every big request: 100 + 4 x 40
    assert split.details["reserved_bytes_default"] == 300 * MiB
    assert split.details["reserved_bytes"] == 260 * MiB
    assert split.bytes_saved == 40 * MiB
    megabytes = int(split.title.rsplit(":", 1)[1])
    assert 20 < megabytes < 100


def test_a_setting_already_in_use_is_not_advised_again(tmp_path):
    trace, base = load(fragmenting_trace(tmp_path / "frag.trace"))
    items = collect(trace, base, hardware("h100-80gb"), providers=[allocator_settings_advice],
                    alloc_conf="expandable_segments:True")
    assert not [a for a in items if "expandable_segments" in a.title]
    # recorded by the profiled run
    trace.meta.allocator = {"settings": "expandable_segments:True"}
    assert not [a for a in collect(trace, base, hardware("h100-80gb"),
                                   providers=[allocator_settings_advice])
                if "expandable_segments" in a.title]
