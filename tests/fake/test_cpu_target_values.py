"""Fake execution on the CPU target: which values are real (real_cpu.py) and how a
value-dependent length is answered from the profiled run (recorded_sizes.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from memadvisor.fake.recorded_sizes import RecordedReads, RecordedShares
from memadvisor.fake.runtime import fake_execution
from memadvisor.profile import ProfileSession, StopProfiling


def _is_fake(tensor) -> bool:
    return hasattr(tensor, "fake_mode")


def test_integer_data_is_real_and_a_decompositions_output_is_not():
    with fake_execution(gpu=None):
        tokens = torch.randint(0, 10, (4, 6))  # the script's data: real, its values known
        lengths = (tokens != 0).sum(1)
        logits = torch.randn(6, 4)  # float: fake
        _, selected = torch.topk(logits, 2, dim=-1)
        # one_hot decomposes into empty_strided + copy_ from a fake tensor: a real output
        # would hold garbage (FakeTensorMode writes into a fake copy), so it is fake
        mask = F.one_hot(selected, num_classes=4)
        assert not _is_fake(tokens) and not _is_fake(lengths)
        assert _is_fake(logits) and _is_fake(selected) and _is_fake(mask)
        counts = torch.zeros(4, dtype=torch.long)  # real, then written by a fake op
        counts.index_add_(0, selected[:, 0], torch.ones(6, dtype=torch.long))
        assert _is_fake(counts + 1)  # its real values are stale: what reads it stays fake


def test_a_value_dependent_length_is_the_profiled_share_of_its_bound():
    recorded = RecordedShares({"idx = torch.where(m)": [[3, 12], [9, 12]]})
    assert recorded.length("idx = torch.where(m)", 24) == 6  # 3/12 of 24
    assert recorded.length("idx = torch.where(m)", 24) == 18  # the next call's share
    assert recorded.length("idx = torch.where(m)", 24) == 6  # cycles
    assert recorded.length("another line", 24) is None


def _scripted_where(mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask)[0]


def test_profile_records_each_value_dependent_length_by_line_text():
    mask = torch.tensor([[True, False, True], [False, False, True]])

    def train():
        # scripted while the entry points are wrapped (ZeroRedundancyOptimizer scripts
        # functional optimizers on import): TorchScript still finds aten::where
        assert torch.jit.script(_scripted_where)(mask).tolist() == [0, 0, 1]
        model = torch.nn.Linear(3, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            rows, cols = torch.where(mask)  # 3 of 6
            kept = torch.randn(2, 3).masked_select(mask)  # 3 of 6
            nz = mask.nonzero()  # 3 of 6
            (model(torch.randn(2, 3)).sum() + kept.sum() + nz.sum() + rows.sum()).backward()
            optimizer.step()

    session = ProfileSession(steps=2, probes=False)
    try:
        with session:
            train()
    except StopProfiling:  # after the second step, as asked
        pass
    _, meta = session.build()
    sizes = meta.extra["value_sizes"]
    assert sizes["rows, cols = torch.where(mask)  # 3 of 6"] == [[3, 6], [3, 6]]
    assert sizes["kept = torch.randn(2, 3).masked_select(mask)  # 3 of 6"] == [[3, 6], [3, 6]]
    assert sizes["nz = mask.nonzero()  # 3 of 6"] == [[3, 6], [3, 6]]
    assert torch.where(mask)[0].tolist() == [0, 0, 1]  # unwrapped again, still torch's
    assert not session.value_sizes._undo


def _lbfgs_closure_calls() -> int:
    """Two LBFGS steps (up to four closure calls each): the calls LBFGS's own stopping
    tests allowed, which read tensor values inside torch.optim."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(16, 3, generator=generator)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5]])
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    calls = []

    def closure():
        calls.append(1)
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss

    for _ in range(2):
        optimizer.step(closure)
    return len(calls)


def test_scalar_reads_are_answered_with_the_profiled_runs_values_by_line():
    session = ProfileSession(steps=3, probes=False)  # more than the run has: it ends
    with session:
        real_calls = _lbfgs_closure_calls()
    _, meta = session.build()
    reads = meta.extra["value_reads"]
    assert reads["if opt_cond:"] and all(value is False for value in reads["if opt_cond:"])
    assert not session.value_reads._undo and "item" not in torch.Tensor.__dict__
    assert real_calls > 2  # the stopping tests let LBFGS evaluate more than once per step
    with fake_execution(gpu=None) as run:
        fake_default = _lbfgs_closure_calls()
    with fake_execution(gpu=None) as run:
        run.mode.placeholder_log.recorded_reads = RecordedReads(reads)
        fake_recorded = _lbfgs_closure_calls()
    # placeholders (bool = True) stop each step at its first test; the recorded values
    # take the real run's branches
    assert fake_default < real_calls
    assert fake_recorded == real_calls


def test_recorded_reads_answer_in_order_as_the_tensors_type():
    reads = RecordedReads({"a": [0.5, 2.0], "flag": [False], "bad": [None]})
    assert reads.value("a", torch.float32) == 0.5
    assert reads.value("a", torch.int64) == 2
    assert reads.value("a", torch.float64) == 0.5  # cycles
    assert reads.value("flag", torch.bool) is False
    assert reads.value("bad", torch.float32) is None  # not finite when recorded
    assert reads.value("other", torch.float32) is None


def _routed(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    rows = torch.where(mask)[0]  # routed rows: their count is the recorded share
    return x[rows].sin().sum(0)


def test_a_checkpoints_recompute_gets_its_forwards_answers():
    """The recorded shares cycle 1/4, 3/4 call by call; a checkpointed call's recompute
    must see the length its forward saw, or checkpoint refuses the recomputed shapes."""
    import inspect

    from torch.utils.checkpoint import checkpoint
    line = next(text.strip() for text in inspect.getsource(_routed).splitlines()
                if "torch.where(mask)" in text)
    with fake_execution(gpu=None) as run:
        run.mode.placeholder_log.recorded = RecordedShares({line: [[1, 4], [3, 4]]})
        x = torch.randn(8, 4, requires_grad=True)
        mask = torch.randn(8) > 0  # fake: the length is answered
        first = checkpoint(_routed, x, mask, use_reentrant=False)
        second = checkpoint(_routed, x, mask, use_reentrant=False)
        (first + second).sum().backward()  # recomputes both, second first
        assert x.grad is not None and x.grad.shape == (8, 4)
        answers = [use.value for use in run.placeholder_log.uses if "where" in use.op
                   or "nonzero" in use.op]
    assert answers[:2] == [repr("the profiled run's share at this line: 2 of 8"),
                           repr("the profiled run's share at this line: 6 of 8")]
    assert answers[2:] == [repr("the checkpointed forward's answer")] * 2
