"""gloo on CPU: a collective's buffers are freed when the script drops them, not when gloo's
worker thread happens to be scheduled.

``ProcessGroupGloo`` runs each collective on a worker thread; the work item holds what the
collective used (an all-gather's output, the reduce-scatter's clone of its input) and the
thread drops its reference after the main thread's ``wait()`` has returned (``runLoop``
releases the work at the end of its iteration).  On a busy CPU that thread may not run for
milliseconds, and the buffer then lives beside the next FSDP unit's buffer: the measured
peak changed run to run (docs/ACCURACY.md, "FSDP on gloo").

Two changes make the release deterministic:

* every gloo group the apply runtime creates has **one** worker thread
  (``ProcessGroupGloo._Options._threads = 1``, torch's default is 2).  The thread takes
  the group's works in order and ends one iteration (dropping that work) before it starts
  the next, so once a later work on the group has completed, every earlier one is gone;
* after each ``wait()`` of a collective (``Work.wait`` from Python: FSDP2 and ``dist.*``;
  ``_c10d_functional.wait_tensor``: DTensor's tensor parallelism) the rank runs a
  all-reduce of an empty tensor on each such group ("drains" it; the tensor is kept, so
  the drain allocates nothing).  When it completes, the worker has let go of everything before it:
  the buffers die when the main thread drops its own reference, at the same point in
  every run.

Every rank waits on the same collectives in the same order (SPMD), so the drains pair up
across ranks like any other collective.  Point-to-point works (send / recv, whose waits
differ between ranks) are not drained.  Under a pipeline the ranks of different stages run
different code, so a group spanning stages (the pipeline's, the world) is excluded
(``exclude``): the drains run on the groups whose members hold one stage (tensor-parallel
peers, a stage's data-parallel replicas), which wait on the same collectives in the same
order.  NCCL (CUDA) is untouched: it works in place, with no such buffers.
"""
from __future__ import annotations

import threading

import torch
import torch.distributed.distributed_c10d as c10d

_lock = threading.Lock()
_creation_patched = False
_drain_installed = False
_original_wait = None
#: the library that holds the AutogradCPU kernel of ``wait_tensor`` (kept alive)
_functional_library = None
#: group name -> the empty tensor each drain all-reduces
_drain_tensors: dict[str, torch.Tensor] = {}
#: names of the groups never drained: their ranks run different code (a pipeline's stages)
_excluded: set[str] = set()
#: drains run so far (tests read it; a count, not a timing)
drains = 0
_draining = threading.local()


def _point_to_point_types() -> frozenset:
    types = torch._C._distributed_c10d.OpType
    return frozenset(int(types.__members__[name]) for name in ("SEND", "RECV", "RECVANYSOURCE")
                     if name in types.__members__)


def one_worker_gloo_class():
    """A ``ProcessGroupGloo`` built with one worker thread (the constructor torch's group
    helper calls: ``(store, rank, size, timeout=...)``)."""
    base = c10d.ProcessGroupGloo

    class OneWorkerGloo(base):
        def __init__(self, store, rank, size, timeout=None):
            options = base._Options()
            if timeout is not None:
                options._timeout = timeout
            options._devices = [base.create_default_device()]
            options._threads = 1
            super().__init__(store, rank, size, options)

    return OneWorkerGloo


def create_groups_with_one_worker() -> None:
    """From now on, every gloo group this process creates (the default one, DeviceMesh's
    subgroups) runs its collectives on one worker thread.  Only torch's group helper sees
    the one-worker class, for the length of each call: everything else keeps the real
    ``ProcessGroupGloo`` (isinstance checks)."""
    global _creation_patched
    with _lock:
        if _creation_patched:
            return
        helper = c10d._new_process_group_helper
        one_worker = one_worker_gloo_class()
        real = c10d.ProcessGroupGloo

        def new_process_group_helper(*args, **kwargs):
            c10d.ProcessGroupGloo = one_worker
            try:
                return helper(*args, **kwargs)
            finally:
                c10d.ProcessGroupGloo = real

        c10d._new_process_group_helper = new_process_group_helper
        _creation_patched = True


def one_worker_groups() -> list:
    """This rank's gloo groups whose backend has one worker thread, in the order they were
    made (the same on every rank), as (group, backend); a backend two groups share
    (DeviceMesh reuses the default group) once."""
    found, seen = [], set()
    for group in list(c10d._world.pg_map):
        try:
            backend = group._get_backend(torch.device("cpu"))
        except RuntimeError:
            continue
        if not isinstance(backend, c10d.ProcessGroupGloo):
            continue
        try:
            threads = backend.options._threads
        except AttributeError:
            continue
        if threads == 1 and group.group_name not in seen | _excluded:
            seen.add(group.group_name)
            found.append((group, backend))
    return found


def drain() -> None:
    """Wait until every one-worker gloo group's thread has finished what came before.

    The drain is an all-reduce of an empty tensor kept for it (it still goes through the
    group's work queue, behind what came before), not a ``barrier``: gloo's barrier
    holds weak references to the works before it, and a c10d work that is still weakly
    referenced keeps its tensors until that reference goes (intrusive_ptr destroys the
    object only when the weak count reaches zero), which the worker thread does late."""
    global drains
    if getattr(_draining, "active", False):
        return
    _draining.active = True
    try:
        for group, backend in one_worker_groups():
            flag = _drain_tensors.get(group.group_name)
            if flag is None:  # a group made after install_drain
                flag = _drain_tensors[group.group_name] = torch.zeros(0, dtype=torch.uint8)
            _original_wait(backend.allreduce([flag]))
        drains += 1
    finally:
        _draining.active = False


def exclude(group) -> None:
    """Never drain ``group`` (None: the world): its ranks do not wait on the same collectives
    in the same order, so a drain there would pair one rank's drain with another's
    collective."""
    _excluded.add((group or c10d._get_default_group()).group_name)


def install_drain() -> bool:
    """Drain the gloo groups after each collective's wait; returns whether it is in place
    (no one-worker gloo group: nothing to drain, nothing installed)."""
    global _drain_installed, _original_wait, _functional_library
    with _lock:
        if _drain_installed:
            return True
        groups = one_worker_groups()
        if not groups:
            return False
        for group, _ in groups:
            _drain_tensors[group.group_name] = torch.zeros(0, dtype=torch.uint8)
        work_class = torch._C._distributed_c10d.Work
        _original_wait = work_class.wait
        point_to_point = _point_to_point_types()

        def wait_then_drain(self, *args, **kwargs):
            result = _original_wait(self, *args, **kwargs)
            if int(self._get_op_type()) not in point_to_point:
                drain()
            return result

        work_class.wait = wait_then_drain

        def wait_tensor_then_drain(tensor):
            with torch._C._AutoDispatchBelowAutograd():
                out = torch.ops._c10d_functional.wait_tensor.default(tensor)
            drain()
            return out

        # the AutogradCPU key runs before the op's own (CompositeExplicitAutograd) kernel,
        # which this one calls below autograd: functional collectives wait in C++
        _functional_library = torch.library.Library("_c10d_functional", "IMPL")
        _functional_library.impl("wait_tensor", wait_tensor_then_drain, "AutogradCPU")
        _drain_installed = True
        return True
