"""The native CPU allocator hook (memadvisor/profile/native.py, cuda_hooks/allocator_hook.cpp)."""
from __future__ import annotations

import shutil
import threading
import time

import numpy as np
import pytest
import torch

from memadvisor.profile import native


@pytest.fixture(scope="module")
def hook():
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler")
    try:
        h = native.AllocatorHook.load()  # builds on first use (about a second)
    except native.NativeHookUnavailable as exc:
        pytest.fail(f"native hook unavailable although a compiler exists: {exc}")
    h.stop()
    h.drain()
    yield h
    h.stop()
    h.drain()


def _recorded(hook, fn):
    """Run fn with recording on; return (result, kinds, ptrs, sizes)."""
    hook.drain()
    hook.start()
    try:
        out = fn()
    finally:
        hook.stop()
    k, p, s = hook.drain()
    return out, k, p, s


def test_alloc_and_free_of_a_tensor(hook):
    hook.drain()
    hook.start()
    try:
        t = torch.empty(1000)
        ptr = t.untyped_storage().data_ptr()
        assert ptr == t.data_ptr()
        k, p, s = hook.drain()
        hits = np.flatnonzero(p == ptr)
        assert len(hits) == 1
        assert k[hits[0]] == 1 and s[hits[0]] == 4000
        del t
        k, p, s = hook.drain()
    finally:
        hook.stop()
    hits = np.flatnonzero(p == ptr)
    assert len(hits) == 1
    assert k[hits[0]] == -1 and s[hits[0]] == 4000
    assert k.dtype == np.int64 and p.dtype == np.uint64 and s.dtype == np.int64


def test_views_report_the_storage_pointer_and_free_when_the_storage_dies(hook):
    hook.start()
    try:
        hook.drain()
        base = torch.empty(100)
        view = base[10:]
        ptr = base.untyped_storage().data_ptr()
        assert view.untyped_storage().data_ptr() == ptr != view.data_ptr()
        del base
        k, p, s = hook.drain()
        assert not np.any((p == ptr) & (k == -1))  # the view keeps the storage alive
        del view
        k, p, s = hook.drain()
    finally:
        hook.stop()
    assert list(zip(k[p == ptr].tolist(), s[p == ptr].tolist())) == [(-1, 400)]


def test_zero_size_allocations_are_not_recorded(hook):
    _, k, p, s = _recorded(hook, lambda: torch.empty(0))
    assert not np.any(s == 0)


def test_free_follows_weakref_callbacks(hook):
    import weakref

    seen = []
    t = torch.empty(256)
    ptr = t.untyped_storage().data_ptr()
    ref = weakref.ref(t, lambda _r: seen.append(hook.drain()))
    hook.drain()
    hook.start()
    try:
        del t
        after = hook.drain()
    finally:
        hook.stop()
    assert ref() is None and len(seen) == 1
    assert not np.any(seen[0][1] == ptr)  # the callback ran before the native free
    assert np.any((after[1] == ptr) & (after[0] == -1))


def _profiler_memory_bytes(prof) -> np.ndarray:
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    return np.array([e.nbytes() for e in events], dtype=np.int64)


def test_conv2d_internal_allocations_match_torch_profiler(hook):
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no mkldnn")
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(8, 16, 32, 32)
    w = torch.randn(32, 16, 3, 3)
    torch.nn.functional.conv2d(x, w)  # warm up (lazy init, primitive caches)
    hook.drain()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        hook.start()
        y = torch.nn.functional.conv2d(x, w)
        out_ptr, out_bytes = y.untyped_storage().data_ptr(), y.untyped_storage().nbytes()
        del y
        hook.stop()
    k, p, s = hook.drain()
    allocs = (k == 1)
    assert np.any(allocs & (p == out_ptr) & (s == out_bytes))
    others = allocs & ~((p == out_ptr) & (s == out_bytes))
    assert np.any(others), "expected kernel-internal allocations (oneDNN scratchpad)"
    hook_peak = native.replay_peak(k, s)
    prof_bytes = _profiler_memory_bytes(prof)
    assert len(prof_bytes) > 0
    prof_peak = int(np.cumsum(prof_bytes).max())
    assert hook_peak > out_bytes
    assert abs(hook_peak - prof_peak) <= 0.01 * prof_peak, (hook_peak, prof_peak)


def test_training_step_matches_torch_profiler_event_for_event(hook):
    from torch import nn
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                          nn.Linear(8 * 15 * 15, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))

    def step():
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    step()
    hook.drain()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        hook.start()
        step()
        hook.stop()
    k, _, s = hook.drain()
    np.testing.assert_array_equal(k * s, _profiler_memory_bytes(prof))


def test_live_and_peak_bytes(hook):
    hook.reset_peak()
    base_live, base_peak = hook.live_bytes, hook.peak_bytes
    assert base_peak == base_live
    t = torch.empty(1 << 20, dtype=torch.uint8)
    assert hook.live_bytes - base_live == 1 << 20
    del t
    assert hook.live_bytes == base_live
    assert hook.peak_bytes - base_peak >= 1 << 20
    hook.reset_peak()
    assert hook.peak_bytes == hook.live_bytes


def test_drain_loops_past_the_buffer_capacity(hook):
    n = native._DRAIN_CAPACITY * 2 + 17

    def many():
        return [torch.empty(4) for _ in range(n)]

    keep, k, p, s = _recorded(hook, many)
    ptrs = {t.untyped_storage().data_ptr() for t in keep}
    mask = np.isin(p, np.fromiter(ptrs, dtype=np.uint64))
    assert int(np.sum(mask & (k == 1))) == n
    assert np.all(s[mask] == 16)
    del keep
    hook.drain()


def test_drain_with_seq_is_gapless(hook):
    before = hook.next_seq
    _, k, p, s = _recorded(hook, lambda: [torch.empty(8) for _ in range(5)])
    hook.start()
    torch.empty(3)
    hook.stop()
    k2, p2, s2, seq = hook.drain_with_seq()
    assert len(seq) >= 2
    np.testing.assert_array_equal(seq, np.arange(seq[0], seq[0] + len(seq)))
    assert seq[0] == before + len(k)


def test_threads_totals_consistent(hook):
    n_threads, per_thread = 4, 2000
    sizes = [16 * (i + 1) for i in range(n_threads)]
    barrier = threading.Barrier(n_threads)
    ptr_sets: list[set[int]] = [set() for _ in range(n_threads)]

    def work(i):
        barrier.wait()
        for _ in range(per_thread):
            t = torch.empty(sizes[i] // 4)
            ptr_sets[i].add(t.untyped_storage().data_ptr())
            del t

    live_before = hook.live_bytes
    hook.drain()
    hook.start()
    threads = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    hook.stop()
    k, p, s = hook.drain()
    assert hook.live_bytes == live_before
    for size in sizes:  # every allocation of each thread's size, each one freed
        assert int(np.sum((k == 1) & (s == size))) >= per_thread
    # replay: no double alloc of a live pointer, every free matches a live allocation
    live: dict[int, int] = {}
    for kind, ptr, size in zip(k.tolist(), p.tolist(), s.tolist()):
        if kind == 1:
            assert ptr not in live
            live[ptr] = size
        else:
            assert live.pop(ptr) == size
    assert not live
    total = int(np.sum(k * s))
    assert total == 0


def test_bogus_compiler_raises_one_line(tmp_path, monkeypatch):
    with pytest.raises(native.NativeHookUnavailable) as info:
        native.AllocatorHook.load(cache=tmp_path, compiler="/nonexistent/bin/g++")
    assert "\n" not in str(info.value) and str(info.value)
    # a "compiler" that runs and fails: the reason carries its first error line
    fake = tmp_path / "fake-cxx"
    fake.write_text("#!/bin/sh\necho 'fatal error: no way' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setenv("MEMADVISOR_CXX", str(fake))
    monkeypatch.setenv("MEMADVISOR_CACHE", str(tmp_path / "cache"))
    with pytest.raises(native.NativeHookUnavailable) as info:
        native.build()
    msg = str(info.value)
    assert "\n" not in msg and "exit 3" in msg and "no way" in msg
    assert not list((tmp_path / "cache").rglob("*.so"))  # nothing half-built left behind


def test_missing_source_raises(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMADVISOR_NATIVE_SRC", str(tmp_path))
    monkeypatch.setattr(native, "__file__", str(tmp_path / "a" / "b" / "c" / "native.py"))
    with pytest.raises(native.NativeHookUnavailable, match="not found"):
        native.build(cache=tmp_path)


def test_build_is_cached_atomic_and_keyed(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMADVISOR_CACHE", str(tmp_path))
    first = native.build()
    assert first.is_file() and first.parent == tmp_path / "native"
    assert [f.name for f in first.parent.iterdir()] == [first.name]  # no temp files left
    t0 = time.perf_counter()
    assert native.build() == first  # cached: no compiler run
    assert time.perf_counter() - t0 < 0.2
    # a different source means a different library (and so a rebuild)
    src = tmp_path / "src"
    src.mkdir()
    (src / native.SOURCE_NAME).write_text(
        (native.source_dir() / native.SOURCE_NAME).read_text() + "\n// changed\n")
    monkeypatch.setenv("MEMADVISOR_NATIVE_SRC", str(src))
    assert native.library_path() != first
    assert native.library_path().parent == first.parent


def test_available_reports_a_reason(hook):
    ok, reason = native.available()
    assert ok and reason



@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="no fork")
def test_fork_child_stops_recording_and_does_not_deadlock(hook):
    import os

    hook.start()
    try:
        torch.empty(10)
        pid = os.fork()
        if pid == 0:  # child: must not inherit a locked mutex or the parent's backlog
            code = 1
            try:
                t = torch.empty(1000)
                code = 0 if (not hook.recording and hook.pending() == 0 and t.numel()) else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert hook.recording
    finally:
        hook.stop()
        hook.drain()
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


# --- covering c10::GetDefaultCPUAllocator() (opt-in, irreversible: keep these last) ------
def _storage_ops():
    st = torch.UntypedStorage(100)
    st.resize_(200)
    del st
    t = torch.randn(50)
    import copy
    import pickle

    d = copy.deepcopy(t)
    u = pickle.loads(pickle.dumps(t))
    del d, u, t


def _hook_vs_profiler(hook, fn):
    from torch.profiler import ProfilerActivity, profile

    fn()
    hook.drain()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        hook.start()
        fn()
        hook.stop()
    k, _, s = hook.drain()
    return k * s, _profiler_memory_bytes(prof)


def test_python_built_storages_bypass_the_setallocator_wrapper(hook):
    if hook.default_covered:
        pytest.skip("default allocator already covered in this process")
    ours, theirs = _hook_vs_profiler(hook, _storage_ops)
    assert len(ours) < len(theirs)  # the documented gap


def test_cover_default_allocator_closes_the_gap():
    """In a fresh interpreter: covering is irreversible, and it needs the hook to wrap c10's
    default allocator directly (in this process the op tracker may sit in between)."""
    import subprocess
    import sys
    from pathlib import Path
    code = ("import sys; sys.path.insert(0, %r); import test_native_hook as t; "
            "from memadvisor.profile import native; "
            "h = native.AllocatorHook.load(); h.stop(); h.drain(); t._cover_and_check(h)"
            % str(Path(__file__).parent))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _cover_and_check(hook):
    hook.cover_default_allocator()
    hook.cover_default_allocator()  # idempotent
    assert hook.default_covered
    ours, theirs = _hook_vs_profiler(hook, _storage_ops)
    np.testing.assert_array_equal(ours, theirs)
    # ordinary tensors still work and still match, event for event
    ours, theirs = _hook_vs_profiler(
        hook, lambda: torch.nn.functional.conv2d(torch.randn(2, 4, 16, 16),
                                                 torch.randn(8, 4, 3, 3)).sum())
    np.testing.assert_array_equal(ours, theirs)
    live = hook.live_bytes
    st = torch.UntypedStorage(4096)
    assert hook.live_bytes == live + 4096
    del st
    assert hook.live_bytes == live
