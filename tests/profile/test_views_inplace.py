"""Views and in-place ops share their base's storage: they must never add bytes.

The expected storage allocations are written out by hand (count, bytes, op) from what the
code does; an extra row means a view or an in-place result was counted as new memory, a
missing one means a real allocation was lost.  Where the native allocator hook runs, the
trace also holds blocks a kernel allocates for itself (dtype ``bytes``): an in-place op
with a Python scalar wraps it in a few-byte tensor.  Those must be transient -- freed
inside the op -- and scalar-sized, so the section's live bytes still do not move.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from memadvisor.profile import ProfileSession
from memadvisor.trace.schema import RAW_BYTES_DTYPE

FLOAT = 4  # bytes of a float32
SCALAR_BYTES = 8  # the largest wrapped scalar (a double or an int64)


def _events(session):
    table, _meta = session.build()
    return table.to_pandas()


def _is_internal(events):
    """Kernel scratch, and Python numbers wrapped into 0-dim tensors for an op (the native
    engine sees those allocations; the dispatch engine gets the numbers back unwrapped)."""
    wrapped = (events["shape"].astype(str) == "") & (events["size_bytes"] == SCALAR_BYTES) \
        & events["dtype"].astype(str).isin(["float64", "int64", "complex128"])
    return (events["dtype"].astype(str) == RAW_BYTES_DTYPE) | wrapped


def _allocs(events, start: int = 0, stop: int | None = None) -> list[tuple[str, int]]:
    """Storage allocations (kernel-internal blocks left out) among events[start:stop]."""
    part = events.iloc[start:stop]
    part = part[(part["action"] == "alloc") & ~_is_internal(part)]
    return list(zip(part["op"].astype(str), part["size_bytes"].astype(int)))


def _assert_internal_blocks_are_transient_scalars(events, start: int = 0,
                                                  stop: int | None = None) -> None:
    part = events.iloc[start:stop]
    internal = part[_is_internal(part)]
    made = internal[internal["action"] == "alloc"]
    freed = internal[internal["action"] == "free"]
    # a wrapped number autograd saves for backward lives on, as an activation
    made = made[made["category"].astype(str) != "activation"]
    assert set(made["storage_id"]) == set(freed["storage_id"]), "a kernel block outlived it"
    assert (made["size_bytes"] <= SCALAR_BYTES).all(), made[["op", "size_bytes"]]
    for sid, op in zip(made["storage_id"], made["op"].astype(str)):
        # freed by the same op that made it
        assert set(freed[freed["storage_id"] == sid]["op"].astype(str)) == {op}


def _live(events) -> int:
    signs = (events["action"].astype(str) == "alloc").to_numpy() * 2 - 1
    return int((events["size_bytes"].to_numpy() * signs).sum())


def _storage_bytes(*tensors) -> int:
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(seen.values())


def _views_and_inplace(a, b, c, row):
    """Every op here but the last returns a view of, or writes into, an existing storage."""
    viewed = a.view(32, 64)
    sliced = a[1:10, 2:5]
    transposed = a.t()
    swapped = a.transpose(0, 1)
    expanded = row.expand(64, 32)
    a.add_(b)
    a.mul_(2.0)
    torch.add(a, b, out=c)  # c is preallocated with the right size
    torch._foreach_add_([a, b], 1.0)
    torch._foreach_add_([a, b], [c, c])
    a.relu_()
    c.copy_(b)
    sliced.zero_()  # in place through a view
    transposed.mul_(0.5)
    swapped[0].fill_(1.0)
    flat = a.reshape(-1)  # contiguous: a view
    squeezed = a.unsqueeze(0).squeeze(0)
    # the control: a real allocation, so the test also proves it can see one
    control = expanded + 0
    return viewed, sliced, transposed, swapped, expanded, flat, squeezed, control


def test_views_and_inplace_ops_allocate_nothing():
    with ProfileSession() as session:
        a = torch.randn(64, 32)
        b = torch.randn(64, 32)
        c = torch.empty(64, 32)
        row = torch.randn(1, 32)
        start = session.recorder.now_seq()
        results = _views_and_inplace(a, b, c, row)
        stop = session.recorder.now_seq()
    events = _events(session)
    assert _allocs(events, 0, start) == [("aten::randn", 64 * 32 * FLOAT),
                                         ("aten::randn", 64 * 32 * FLOAT),
                                         ("aten::empty", 64 * 32 * FLOAT),
                                         ("aten::randn", 32 * FLOAT)]
    # only the control allocates a storage in the section; no storage was freed either
    assert _allocs(events, start, stop) == [("aten::add", 64 * 32 * FLOAT)]
    section = events.iloc[start:stop]
    assert (section[~_is_internal(section)]["action"] == "alloc").all()
    _assert_internal_blocks_are_transient_scalars(events, start, stop)
    assert _live(section) == 64 * 32 * FLOAT
    # what is alive at the end is exactly the storages we still hold
    assert _live(events) == _storage_bytes(a, b, c, row, *results)


class _ViewNet(nn.Module):
    """One Linear; with ``ops`` its output goes through views and in-place ops, and a
    buffer is updated in place with ``out=``, ``_foreach_add_`` and ``copy_``."""

    def __init__(self, ops: bool):
        super().__init__()
        self.lin = nn.Linear(32, 32)
        self.ops = ops
        self.register_buffer("buf", torch.zeros(64, 32))

    def forward(self, x):
        y = self.lin(x)
        if self.ops:
            y = y.view(4, 16, 32).transpose(1, 2).transpose(1, 2).reshape(64, 32)
            y = y.t().t()[:, :]
            y.add_(1.0)
            y.mul_(0.5)
            y.relu_()
            bias = self.lin.bias.expand(64, 32)
            with torch.no_grad():
                torch.add(y.detach(), bias, out=self.buf)
                torch._foreach_add_([self.buf], 1.0)
                self.buf.copy_(y.detach())
                self.buf[1:3].mul_(2)
        return y.sum()


def _forward(ops: bool):
    """(storage allocations in forward, live bytes when forward ends, events)."""
    torch.manual_seed(0)
    model = _ViewNet(ops)
    x = torch.randn(64, 32)
    with ProfileSession() as session:
        model(x).backward()
    events = _events(session)
    in_forward = (events["phase"] == "forward").to_numpy()
    end_of_forward = int(in_forward.nonzero()[0].max()) + 1
    forward = events[in_forward & (events["action"] == "alloc").to_numpy()
                     & ~_is_internal(events).to_numpy()]
    allocs = list(zip(forward["op"].astype(str), forward["size_bytes"].astype(int),
                      forward["category"].astype(str)))
    return allocs, _live(events.iloc[:end_of_forward]), events.iloc[:end_of_forward]


def _saved_wrapped_numbers(events) -> int:
    """Bytes of Python numbers wrapped into tensors that autograd saved (mul_(0.5) saves
    its 0.5 for backward), alive at the end of ``events``."""
    internal = events[_is_internal(events)]
    signs = (internal["action"].astype(str) == "alloc").to_numpy() * 2 - 1
    live = int((internal["size_bytes"].to_numpy() * signs).sum())
    assert (internal[internal["action"] == "alloc"]["size_bytes"] <= SCALAR_BYTES).all()
    return live


def test_views_and_inplace_ops_in_a_models_forward_add_no_bytes():
    plain, plain_live, _ = _forward(ops=False)
    with_ops, with_ops_live, forward_events = _forward(ops=True)
    # the model, its buffer and the batch (made before the session: registered when first
    # used), the Linear's output and the loss (backward's seed gradient is backward's)
    expected_bytes = [32 * 32 * FLOAT, 32 * FLOAT, 64 * 32 * FLOAT, 64 * 32 * FLOAT,
                      64 * 32 * FLOAT, FLOAT]
    assert [size for _, size, _ in plain] == expected_bytes
    assert [(op, size) for op, size, _ in with_ops] == [(op, size) for op, size, _ in plain]
    # relu_ saves its output for backward: the Linear's output stays alive; without the
    # ops nothing saves it (sum's backward needs no input) and it dies in forward
    saved_numbers = _saved_wrapped_numbers(forward_events)  # 0 with the dispatch engine
    assert with_ops_live == sum(expected_bytes) + saved_numbers
    assert plain_live == sum(expected_bytes) - 64 * 32 * FLOAT
    _assert_internal_blocks_are_transient_scalars(forward_events)
    categories = [category for _, _, category in with_ops]
    assert categories[:3] == ["parameter", "parameter", "buffer"]


def test_manual_parameter_update_in_place_adds_nothing():
    torch.manual_seed(0)
    model = nn.Linear(16, 8)
    x = torch.randn(4, 16)
    with ProfileSession() as session:
        model(x).sum().backward()
        start = session.recorder.now_seq()
        with torch.no_grad():
            for param in model.parameters():
                param.add_(param.grad, alpha=-0.1)
                param.grad.zero_()
            torch._foreach_mul_(list(model.parameters()), 0.99)
        stop = session.recorder.now_seq()
    events = _events(session)
    assert _allocs(events, start, stop) == []
    _assert_internal_blocks_are_transient_scalars(events, start, stop)
    assert _live(events.iloc[start:stop]) == 0


def test_out_into_a_too_small_tensor_counts_the_growth():
    """``out=`` into an empty tensor resizes its storage in place: the trace must follow
    the storage to its real size, or every later figure is off by those bytes."""
    with ProfileSession() as session:
        a = torch.randn(64, 32)
        b = torch.randn(64, 32)
        out = torch.empty(0)
        torch.add(a, b, out=out)
        total = a + 0  # a plain allocation after the resize
    events = _events(session)
    live = _live(events)
    assert out.untyped_storage().nbytes() == 64 * 32 * FLOAT
    assert live == _storage_bytes(a, b, out, total)
