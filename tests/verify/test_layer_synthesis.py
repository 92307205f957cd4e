"""verify/layer_synthesis.py: a deep stack's stream of requests made from two shallow runs
-- on hand-made streams with the structures a training step has (activations kept for
backward, a layer's output freed by the next layer's backward, temporaries, a buffer over
all parameters that grows per layer, frees in hash order), so that every expectation is
known exactly."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from memadvisor.verify import layer_synthesis as ls
from memadvisor.verify.shallow_runs import run_shallow


def _stream(layers: int, shuffle_frees: bool = False, bucket_cap: int | None = None):
    """Two training steps of a ``layers``-deep stack, as device rows of a trace."""
    rows = []
    ids = iter(range(10**6))

    def alloc(size, op, module, phase, step, line, category="activation"):
        storage = next(ids)
        rows.append(dict(action="alloc", storage_id=storage, size_bytes=size, op=op,
                         module=module, phase=phase, step=step, source_line=line,
                         category=category))
        return rows[-1]

    def free(made, phase, step):
        rows.append({**made, "action": "free", "phase": phase, "step": step})

    rng = np.random.default_rng(layers)
    # the model built in fp32, then converted layer by layer (model.to(bfloat16)): each
    # layer's new copy made, then its old one freed -- the oldest first
    built = [alloc(8192, "aten::empty", "", "other", 0, 30, "other") for _ in range(layers)]
    for i in range(layers):
        alloc(4096, "aten::_to_copy", f"blocks.{i}", "other", 0, 31, "parameter")
        free(built[i], "other", 0)
    for step in range(2):
        outputs, saved = [], []
        x = alloc(2048, "aten::embedding", "emb", "forward", step, 5)
        outputs.append(x)
        for i in range(layers):
            act = alloc(4096, "aten::mm", f"blocks.{i}.fc", "forward", step, 10)
            tmp = alloc(1024, "aten::gelu", f"blocks.{i}.act", "forward", step, 11)
            out = alloc(2048, "aten::add", f"blocks.{i}", "forward", step, 12)
            free(tmp, "forward", step)
            saved.append(act)
            outputs.append(out)
        for i in reversed(range(layers)):
            grad = alloc(4096, "aten::mm", f"blocks.{i}.fc", "backward", step, 0, "temporary")
            free(saved[i], "backward", step)
            free(outputs[i + 1], "backward", step)
            free(grad, "backward", step)
        free(outputs[0], "backward", step)
        # a flat buffer over every layer's parameters (ZeRO's, clip_grad_norm_'s stack)
        size = 96 * layers + 32
        if bucket_cap:
            size = min(size, bucket_cap)
        flat = alloc(size, "aten::cat", "", "optimizer", step, 20, "temporary")
        # Adam's foreach ops, one per parameter group (decay: each layer's two weights; no
        # decay: each layer's two norms, the final norm): one output per parameter, all
        # made, then all freed -- one group's frees end where the next one's allocs begin,
        # and one layer's rows on both sides may be aligned side by side
        for group in ([], [4096, 8192], []), ([], [256, 256], [256]):
            first, per_layer, last = group
            outs = [alloc(size, "aten::_foreach_sqrt", "", "optimizer", step, 40, "temporary")
                    for size in first + per_layer * layers + last]
            for out in outs:
                free(out, "optimizer", step)
        # autocast's cache of weight copies, freed in hash order
        copies = [alloc(512, "aten::_to_copy", f"blocks.{i}.fc", "other", step, 21,
                        "autocast_weight") for i in range(layers)]
        order = rng.permutation(layers) if shuffle_frees else range(layers)
        for i in order:
            free(copies[i], "other", step)
        free(flat, "optimizer", step)
    frame = pd.DataFrame(rows)
    frame["seq"] = np.arange(len(frame))
    frame["time_ns"] = frame["seq"] * 1000
    frame["device"] = "cuda:0"
    for column, value in (("dtype", "float32"), ("shape", ""), ("source_file", "train.py"),
                          ("source_function", "main"), ("block_bytes", 0), ("stream", 0),
                          ("address", 0)):
        frame[column] = value
    return frame


def _rows(layers: int, **kwargs) -> pd.DataFrame:
    return ls.device_rows(_stream(layers, **kwargs), "cuda:0", ["blocks"], layers)


@pytest.mark.parametrize("target", [4, 9, 40])
def test_the_stream_made_from_two_and_three_layers_is_the_deeper_run(target):
    model = ls.fit(_rows(2), _rows(3), 3)
    made = model.at(target)
    ran = _rows(target)
    assert ls.first_difference(made, ran) == ""
    # each free frees the storage made at the same position, cross-layer frees included
    assert ls.pairing_differences(made, ran) == 0
    # the flat buffer grew by 96 bytes per layer
    flat = made[(made["op"] == "aten::cat") & (made["action"] == "alloc")]
    assert set(flat["size_bytes"]) == {96 * target + 32}


def test_frees_in_hash_order_do_not_break_the_alignment():
    model = ls.fit(_rows(2, shuffle_frees=True), _rows(3, shuffle_frees=True), 3)
    assert ls.first_difference(model.at(7), _rows(7, shuffle_frees=True)) == ""


def test_a_size_that_stops_growing_is_found_at_the_check():
    """A buffer capped in size (DDP's buckets) grows from 2 to 3 layers and not after: the
    4-layer stream made from 2 and 3 differs from the 4-layer run, so nothing is made."""
    cap = 96 * 3 + 32
    model = ls.fit(_rows(2, bucket_cap=cap), _rows(3, bucket_cap=cap), 3)
    difference = ls.first_difference(model.at(4), _rows(4, bucket_cap=cap))
    assert "aten::cat" in difference and "B ran" in difference


def test_runs_that_do_not_differ_by_a_layer_are_refused():
    shallow, deeper = _rows(2), _rows(3)
    changed = deeper.copy()
    changed.loc[changed["op"] == "aten::embedding", "op"] = "aten::index_select"
    with pytest.raises(ls.SynthesisError, match="do not differ by one layer"):
        ls.fit(shallow, changed, 3)


def test_layer_roles_name_the_stack_index_only():
    rows = ls.device_rows(_stream(3), "cuda:0", ["blocks"], 3)
    assert {"blocks.first.fc", "blocks.middle.fc", "blocks.last.fc"} <= set(rows["layer"])
    assert set(rows.loc[rows["module"] == "emb", "layer"]) == {"emb"}
    assert set(rows["any_layer"]) >= {"blocks.#.fc", "blocks.#"}


def test_stack_paths_follow_fsdp_renamed_layers():
    modules = [{"path": "", "type": "FSDPGPT"}, {"path": "h", "type": "ModuleList"},
               *({"path": f"h.{i}", "type": "FSDPBlock"} for i in range(3)),
               {"path": "h.0.mlp", "type": "Sequential"},
               *({"path": f"h.0.mlp.{i}", "type": "Linear"} for i in range(2))]
    assert ls.stack_paths(modules, {"Block"}, 3) == ["h"]


# --- run_shallow's fall-backs (no trace is read on these paths) --------------------------
def _result(stacks=None, status="completed"):
    return {"status": status, "steps_completed": 3, "trace_path": "unused",
            "layer_stacks": {"stacks": stacks or []} if stacks is not None else None}


def test_a_script_with_nothing_to_cut_runs_once():
    asked = []

    def run_at(keep):
        asked.append(keep)
        return _result(stacks=[])

    result = run_shallow(run_at, None, None)
    assert asked == [2] and "peaks" not in result and "shallow_refused" not in result


def test_a_cut_run_that_fails_runs_in_full_and_says_why():
    asked = []

    def run_at(keep):
        asked.append(keep)
        return _result(status="failed") if keep else _result()

    result = run_shallow(run_at, None, None)
    assert asked == [2, None]
    assert "failed with its layers cut to 2" in result["shallow_refused"]


def test_stacks_of_different_depths_run_in_full():
    stacks = [{"layer": "EncoderLayer", "layers": 6, "source": "a.py:1"},
              {"layer": "DecoderLayer", "layers": 12, "source": "a.py:2"}]
    asked = []

    def run_at(keep):
        asked.append(keep)
        return _result(stacks=stacks)

    result = run_shallow(run_at, None, None)
    assert asked == [2, 3, 4, None]
    assert "different depths (6, 12)" in result["shallow_refused"]
