"""One rank of an N-rank job, alone, on torch's fake process group.

``init_process_group`` is redirected to the ``fake`` backend
(``torch.testing._internal.distributed.fake_pg``: collectives return at once, their
outputs are the right shape and garbage), whatever backend the script asks for (nccl,
gloo, ``cuda:nccl,cpu:gloo``) and whatever store or init method it names, with the rank
and world size fake execution was given.  torchrun's environment (RANK, WORLD_SIZE,
LOCAL_RANK, ...) is set for the script to read.

``init_device_mesh`` runs outside fake mode: it builds its rank map with ``torch.arange``
and reads it back (``tolist``), which on fake tensors would read placeholders.  It is
patched where it is defined and in every loaded module that imported it by name
(FSDP2's ``fully_shard`` builds its default mesh through such an import).
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily

from .patching import Patches

GPUS_PER_NODE = 8


def torchrun_environment(rank: int, num_ranks: int) -> dict[str, str]:
    """What torchrun would set for ``rank`` of ``num_ranks`` on nodes of up to 8 GPUs."""
    local_world_size = min(num_ranks, GPUS_PER_NODE)
    return {"RANK": str(rank), "WORLD_SIZE": str(num_ranks),
            "LOCAL_RANK": str(rank % local_world_size),
            "LOCAL_WORLD_SIZE": str(local_world_size),
            "GROUP_RANK": str(rank // local_world_size),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


class EnvironmentPatch:
    def __init__(self, values: dict[str, str]):
        self._saved = {name: os.environ.get(name) for name in values}
        os.environ.update(values)

    def undo(self) -> None:
        for name, old in self._saved.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


def install(rank: int, num_ranks: int) -> Patches:
    """Redirect process-group creation to the fake backend as ``rank`` of ``num_ranks``."""
    if not dist.is_available():
        return Patches()
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"
    patches = Patches()
    original_init = dist.init_process_group

    def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1,
                           rank_=-1, store=None, group_name="", pg_options=None,
                           device_id=None, **kwargs):
        # the script's backend, store, rank and world size describe the real job; the
        # fake job is this rank of num_ranks, talking to nobody
        kwargs.pop("rank", None)
        extra = {"timeout": timeout} if timeout is not None else {}
        with unset_fake_temporarily():
            return original_init("fake", store=FakeStore(), rank=rank, world_size=num_ranks,
                                 group_name=group_name, **extra)

    patches.set(dist, "init_process_group", init_process_group)
    patches.set(dist.distributed_c10d, "init_process_group", init_process_group)

    from torch.distributed import device_mesh
    original_mesh = device_mesh.init_device_mesh

    def init_device_mesh(*args, **kwargs):
        with unset_fake_temporarily():
            return original_mesh(*args, **kwargs)

    for module in list(sys.modules.values()):
        if getattr(module, "init_device_mesh", None) is original_mesh:
            patches.set(module, "init_device_mesh", init_device_mesh)
    # DDP's constructor compares parameter shapes across ranks in C++, reading the
    # parameters' data (fake: none); a fake job's ranks are the same script, so there is
    # nothing to compare
    from torch.distributed import utils as dist_utils
    original_verify = dist_utils._verify_param_shape_across_processes

    def verify_param_shapes(process_group, tensors, logger=None):
        return None

    for module in list(sys.modules.values()):
        if getattr(module, "_verify_param_shape_across_processes", None) is original_verify:
            patches.set(module, "_verify_param_shape_across_processes", verify_param_shapes)
    _complete_ddp_allreduce(patches)
    # the class's own constructor reads its rank map back too
    original_mesh_init = device_mesh.DeviceMesh.__init__

    def mesh_init(self, *args, **kwargs):
        with unset_fake_temporarily():
            original_mesh_init(self, *args, **kwargs)

    patches.set(device_mesh.DeviceMesh, "__init__", mesh_init)
    _same_objects_on_every_rank(patches, rank)
    return patches


def _same_objects_on_every_rank(patches: Patches, rank: int) -> None:
    """Object collectives (Lightning and the HF Trainer broadcast a run's name, a seed, a
    log folder with ``broadcast_object_list``) pickle into byte tensors that the fake
    group never fills -- unpickling them read a fake tensor (``.numpy()`` of a subclass).
    A fake job's ranks run the same script, so what another rank sends is what this one
    holds: broadcast keeps the local objects, all-gather and gather repeat them."""
    def broadcast_object_list(object_list, src=None, group=None, device=None, group_src=None):
        return None

    def all_gather_object(object_list, obj, group=None):
        object_list[:] = [obj] * len(object_list)

    def gather_object(obj, object_gather_list=None, dst=None, group=None, group_dst=None):
        if object_gather_list is not None:
            object_gather_list[:] = [obj] * len(object_gather_list)

    for name, replacement in (("broadcast_object_list", broadcast_object_list),
                              ("all_gather_object", all_gather_object),
                              ("gather_object", gather_object)):
        original = getattr(dist.distributed_c10d, name)
        for module in list(sys.modules.values()):
            if getattr(module, name, None) is original:
                patches.set(module, name, replacement)


def _fake_allreduce(_state, bucket):
    """DDP's gradient all-reduce on the fake group: done, in place, at once.  (The fake
    group's own future carries no tensors, which DDP's built-in hook asserts on; NCCL's
    all-reduce writes into the bucket and allocates nothing, like this.)"""
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


class _Forwarding:
    """A stand-in for one of DDP's C++ helpers: every attribute but those overridden is
    the helper's own (C++ keeps its reference to the real one)."""

    def __init__(self, wrapped):
        self._wrapped = wrapped

    def __getattr__(self, name):
        return getattr(self._wrapped, name)


class _UntimedLogger(_Forwarding):
    """DDP's logger without its runtime statistics: they time the step with the device's
    timer, which a CPU-only build has none of for 'cuda' (c10d asserts ``timer_``)."""

    def set_runtime_stats_and_log(self):
        return None


class _FixedBuckets(_Forwarding):
    """DDP's reducer keeping its first buckets: rebuilding them in gradient-ready order
    agrees on the order across ranks by reading index tensors' values (fake: none).  The
    rebuilt buckets hold the same gradients, so the bytes are the same."""

    def _rebuild_buckets(self):
        return False


def _complete_ddp_allreduce(patches: Patches) -> None:
    """Give every DDP module without a communication hook of its own ``_fake_allreduce``,
    at its first forward (a hook the script registers after construction stays its own)."""
    from torch.nn.parallel import DistributedDataParallel
    original_forward = DistributedDataParallel.forward

    def forward(self, *args, **kwargs):
        if not self._comm_hooks:
            self.register_comm_hook(None, _fake_allreduce)
        if self.logger is not None and not isinstance(self.logger, _UntimedLogger):
            self.logger = _UntimedLogger(self.logger)
        if not isinstance(self.reducer, _FixedBuckets):  # after the hook: pybind needs the real one
            self.reducer = _FixedBuckets(self.reducer)
        return original_forward(self, *args, **kwargs)

    patches.set(DistributedDataParallel, "forward", forward)


def shutdown() -> None:
    """Destroy the fake default group, if the script left one."""
    if dist.is_available() and dist.is_initialized():
        with unset_fake_temporarily():
            dist.destroy_process_group()
