"""Categories, module paths, phases, steps and source lines on the GPT example, and
autocast weight copies on a model of our own."""
from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from memadvisor.profile import ProfileSession, StopProfiling

N_LAYER = 2  # the GPT example's default --n-layer


@pytest.fixture(scope="module")
def gpt(example_runs):
    return example_runs.get("gpt_lm")


def _allocs(events, **equal):
    mask = events["action"] == "alloc"
    for column, value in equal.items():
        mask &= events[column].astype(str) == value
    return events[mask]


def test_activations_carry_module_paths(gpt):
    modules = set(_allocs(gpt.trace.events, category="activation")["module"].astype(str))
    for layer in range(N_LAYER):
        for path in (f"blocks.{layer}.attn", f"blocks.{layer}.attn.qkv",
                     f"blocks.{layer}.mlp.fc", f"blocks.{layer}.mlp.act",
                     f"blocks.{layer}.ln_1", f"blocks.{layer}.ln_2"):
            assert path in modules, f"no activation attributed to {path}"
    known = {m["path"] for m in gpt.trace.meta.modules}
    assert modules <= known, modules - known


def test_activations_are_made_in_forward_and_freed_by_backward(gpt):
    events = gpt.trace.events
    activations = events[events["category"].astype(str) == "activation"]
    made = activations[activations["action"] == "alloc"]
    assert set(made["phase"].astype(str)) == {"forward"}
    freed = activations[activations["action"] == "free"]
    # in each complete step, every activation made in forward is gone by the step's end
    for step in range(3):
        made_ids = set(made[made["step"] == step]["storage_id"])
        freed_ids = set(freed[freed["step"] == step]["storage_id"])
        assert made_ids and made_ids <= freed_ids, step


def test_activation_source_lines_are_in_the_examples_forward_methods(gpt):
    """Each activation is attributed to a line of the example inside the forward() of
    the innermost module class the example defines (torch's own files are skipped)."""
    example = gpt.module
    example_file = Path(example.__file__).resolve()
    classes = {name: getattr(example, name) for name in
               ("GPT", "Block", "CausalSelfAttention", "MLP")}
    spans = {}
    for name, cls in classes.items():
        lines, first = inspect.getsourcelines(cls.forward)
        spans[name] = range(first, first + len(lines))
    types = {m["path"]: m["type"] for m in gpt.trace.meta.modules}
    made = _allocs(gpt.trace.events, category="activation")
    assert len(made) > 0
    for path, file, line, function in zip(made["module"].astype(str),
                                          made["source_file"].astype(str),
                                          made["source_line"], made["source_function"].astype(str)):
        assert Path(file).resolve() == example_file
        assert function == "forward"
        owner = path
        while types.get(owner) not in classes:
            owner = owner.rsplit(".", 1)[0] if "." in owner else ""
        assert line in spans[types[owner]], (path, line, types[owner])


def test_backward_events_carry_module_paths(gpt):
    backward = _allocs(gpt.trace.events, phase="backward")
    assert len(backward) > 0
    modules = set(backward["module"].astype(str))
    for layer in range(N_LAYER):
        for path in (f"blocks.{layer}.attn.qkv", f"blocks.{layer}.mlp.fc",
                     f"blocks.{layer}.mlp.proj"):
            assert path in modules, f"no backward allocation attributed to {path}"
    in_blocks = backward["module"].astype(str).str.startswith("blocks.")
    assert in_blocks.mean() > 0.5


def test_each_step_has_forward_backward_and_optimizer_in_order(gpt):
    events = gpt.trace.events
    for step in range(3):
        phases = events[events["step"] == step]["phase"].astype(str).tolist()
        for phase in ("forward", "backward", "optimizer"):
            assert phase in phases, (step, phase)
        first = {phase: phases.index(phase) for phase in ("forward", "backward", "optimizer")}
        assert first["forward"] < first["backward"] < first["optimizer"], step
        # the optimizer step is the end of the step: nothing runs after it
        assert phases[-1] == "optimizer", step


def test_optimizer_state_is_made_once_in_the_first_optimizer_step(gpt):
    state = _allocs(gpt.trace.events, category="optimizer_state")
    assert set(state["phase"].astype(str)) == {"optimizer"}
    assert set(state["step"]) == {0}
    freed = gpt.trace.events[(gpt.trace.events["action"] == "free")
                             & (gpt.trace.events["category"].astype(str) == "optimizer_state")]
    assert freed.empty


def test_steps_of_a_stopped_run(gpt):
    # StopProfiling is raised at the third optimizer step: no events after it
    assert sorted(set(gpt.trace.events["step"])) == [0, 1, 2]
    assert gpt.trace.meta.steps_completed == 3
    assert gpt.trace.meta.status == "completed"


def test_a_run_that_ends_by_itself_has_a_trailing_partial_step(example_loader):
    """Three steps of the script and no stop: steps 0..2 complete, then step 3 holds what
    happened after the last optimizer step (main() returning frees its tensors)."""
    example = example_loader("gpt_lm")
    with ProfileSession() as session:
        example.main(["--steps", "3"])
    table, meta = session.build()
    events = table.to_pandas()
    assert sorted(set(events["step"])) == [0, 1, 2, 3]
    assert meta.steps_completed == 3
    assert len(meta.steps) == 3
    trailing = events[events["step"] == 3]
    assert set(trailing["action"].astype(str)) == {"free"}
    assert set(trailing["phase"].astype(str)) == {"other"}


def test_gradients_exist_and_belong_to_parameters(gpt):
    grads = _allocs(gpt.trace.events, category="gradient")
    assert len(grads) > 0
    assert set(grads["phase"].astype(str)) == {"backward"}
    model = gpt.module.GPT(vocab_size=256, seq_len=32, n_layer=N_LAYER, d_model=64, n_head=4)
    # one gradient per (unique) parameter per step, of its size (a bias's gradient may be
    # made as (1, n) by a keepdim sum: compare bytes, not shapes)
    expected = sorted(p.numel() * p.element_size() for p in model.parameters())
    for step in range(3):
        assert sorted(grads[grads["step"] == step]["size_bytes"].astype(int)) == expected, step


def test_the_batch_is_input(gpt):
    inputs = _allocs(gpt.trace.events, category="input")
    # x and y of (batch 4, seq 32) int64 token ids, every step
    assert len(inputs) == 2 * 3
    assert set(inputs["shape"].astype(str)) == {"4,32"}
    assert set(inputs["dtype"].astype(str)) == {"int64"}
    assert gpt.trace.meta.batch["batch_size"] == 4
    assert gpt.trace.meta.batch["shapes"] == [[4, 32], [4, 32]]


def test_a_batch_made_before_the_session_is_input():
    """Data that existed before profiling began and is fed to the model is still the
    batch: registered when first seen, in the root module's forward."""
    torch.manual_seed(0)
    model = nn.Linear(32, 8)
    x = torch.randn(64, 32)
    with ProfileSession() as session:
        model(x).sum().backward()
    table, meta = session.build()
    events = table.to_pandas()
    first = events[(events["action"] == "alloc") & (events["shape"].astype(str) == "64,32")]
    assert len(first) == 1
    assert first["category"].astype(str).tolist() == ["input"]
    assert meta.batch["shapes"] == [[64, 32]]


def test_meta_batch_describes_the_models_input_not_the_loss_modules():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 16), nn.ReLU(), nn.Linear(16, 1))
    loss_fn = nn.MSELoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        with ProfileSession(steps=2) as session:
            for _ in range(5):
                x, y = torch.randn(32, 20), torch.randn(32, 1)
                loss = loss_fn(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    except StopProfiling:
        pass
    _table, meta = session.build()
    assert meta.batch["shapes"][0] == [32, 20]
    assert meta.batch["batch_size"] == 32


class _Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 8)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def test_autocast_weight_copies_are_labelled():
    torch.manual_seed(0)
    model = _Small()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        with ProfileSession(steps=2) as session:
            for _ in range(5):
                x = torch.randn(16, 32)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(x).float().pow(2).mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
    except StopProfiling:
        pass
    table, meta = session.build()
    events = table.to_pandas()
    copies = events[(events["action"] == "alloc")
                    & (events["category"].astype(str) == "autocast_weight")]
    params = dict(model.named_parameters())
    # every parameter is cast to bfloat16 once per forward, in both steps
    expected = sorted((",".join(map(str, p.shape)), p.numel() * 2) for p in params.values()) * 2
    assert sorted(zip(copies["shape"].astype(str), copies["size_bytes"].astype(int))) == \
        sorted(expected)
    assert set(copies["dtype"].astype(str)) == {"bfloat16"}
    assert set(copies["phase"].astype(str)) == {"forward"}
    assert set(copies["op"].astype(str)) == {"aten::_to_copy"}
    assert set(copies["module"].astype(str)) == {"fc1", "fc2"}
    # the float32 masters stay parameters; the casts of activations are not weights
    parameters = events[(events["action"] == "alloc")
                        & (events["category"].astype(str) == "parameter")]
    assert set(parameters["dtype"].astype(str)) == {"float32"}
    assert int(parameters["size_bytes"].sum()) == sum(p.numel() * 4 for p in params.values())
    assert meta.steps_completed == 2
