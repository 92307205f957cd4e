"""What the input pipeline costs: each ``torch.utils.data.DataLoader`` the script iterates.

Recorded per loader (the trace's ``data_loaders`` metadata, docs/TRACE.md): its settings
(``num_workers``, ``prefetch_factor``, ``pin_memory`` as asked and as done, ...) and the
line that made it; per batch the time the main process waited in the iterator's
``__next__`` and the batch's host bytes (pinned or not); the batch's copies to a device
(``.to``, ``.cuda``, ``copy_``: bytes, ``non_blocking``, whether the source was pinned, the
line); and the worker processes' host memory, sampled.

All of it happens per batch, never per op: ``__next__`` is wrapped once for every
DataLoader iterator class, and the copy wrappers on ``Tensor.to``/``cuda``/``copy_`` are
installed only from a batch's arrival until the next forward begins (the window where a
training loop moves its batch), then removed.

Workers' memory is best effort, sampled at batches (worker_memory.py).
"""
from __future__ import annotations

import bisect
import os
import weakref
from collections.abc import Mapping

import torch
from torch.utils.data import DataLoader
from torch.utils.data import dataloader as _dataloader

from .worker_memory import WorkerMemory

#: attribute an iterator carries: the record of the loader that made it
_RECORD_ATTR = "_memadvisor_loader_record"
#: tensors looked at in one batch (a batch of a thousand tensors is described by these)
_MAX_BATCH_TENSORS = 256


class LoaderRecord:
    """What one DataLoader did while profiled (plain Python values only)."""

    def __init__(self, settings: dict, source: tuple[str, int, str]):
        self.settings = settings
        self.source = source
        #: (start_ns, wait_ns, batch_bytes, pinned_bytes)
        self.batches: list[tuple[int, int, int, int]] = []
        #: (time_ns, bytes, device, non_blocking, source_pinned, from_batch, (file, line))
        self.copies: list[tuple] = []
        self.workers = WorkerMemory()
        #: batches whose description failed (an unusual batch type): not recorded
        self.problems = 0

    def describe(self, boundary_ns: list[int]) -> dict:
        steps: dict[int, dict] = {}

        def step_of(time_ns: int) -> dict:
            index = bisect.bisect_right(boundary_ns, time_ns)
            return steps.setdefault(index, {
                "index": index, "batches": 0, "wait_s": 0.0, "batch_bytes": 0,
                "copy_bytes": 0, "non_blocking_copy_bytes": 0, "pinned_copy_bytes": 0})
        for start_ns, wait_ns, size, _pinned in self.batches:
            entry = step_of(start_ns)
            entry["batches"] += 1
            entry["wait_s"] += wait_ns / 1e9
            entry["batch_bytes"] += size
        sites: dict[tuple, dict] = {}
        for time_ns, size, device, non_blocking, pinned, from_batch, where in self.copies:
            entry = step_of(time_ns)
            entry["copy_bytes"] += size
            entry["non_blocking_copy_bytes"] += size if non_blocking else 0
            entry["pinned_copy_bytes"] += size if pinned else 0
            key = (where, device, non_blocking, pinned, from_batch)
            site = sites.setdefault(key, {
                "source": f"{where[0]}:{where[1]}" if where[0] else "", "device": device,
                "non_blocking": non_blocking, "source_pinned": pinned,
                "from_batch": from_batch, "calls": 0, "bytes": 0})
            site["calls"] += 1
            site["bytes"] += size
        file, line, function = self.source
        described = {
            **self.settings,
            "source": f"{file}:{line}" if file else "", "function": function,
            "batches": len(self.batches),
            "wait_s": sum(wait for _, wait, _, _ in self.batches) / 1e9,
            "batch_bytes": max((size for _, _, size, _ in self.batches), default=0),
            "batch_pinned_bytes": max((p for _, _, _, p in self.batches), default=0),
            "steps": [steps[index] for index in sorted(steps)],
            "copies": list(sites.values()),
            "cpu_count": _cpu_count(), "host_memory_bytes": _host_memory_bytes(),
        }
        if self.problems:
            described["batches_not_described"] = self.problems
        if self.settings.get("num_workers"):
            described["workers_memory"] = self.workers.describe()
        return described


class DataLoaderWatch:
    """Install with ``install()``, remove with ``uninstall()``; ``describe(boundary_ns)``
    gives the trace's ``data_loaders`` entries.  ``clock()`` is the recorder's time
    (nanoseconds since profiling began), so batches fall into the trace's steps."""

    def __init__(self, clock, locator):
        self.clock = clock
        self.locator = locator
        self.records: list[LoaderRecord] = []
        self._sites: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        #: loader -> its record: the iterators of every epoch add to one
        self._by_loader: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._saved: list[tuple[object, str, object]] = []
        self._copy_saved: list[tuple[object, str, object]] = []
        #: the record whose batch is being moved, and id -> weakref of its tensors
        self._window: LoaderRecord | None = None
        self._pending: dict[int, weakref.ref] = {}

    # --- install -------------------------------------------------------------------------
    def install(self) -> None:
        if self._saved:
            return
        watch = self
        original_init = DataLoader.__init__
        original_iter = DataLoader.__iter__
        original_next = _dataloader._BaseDataLoaderIter.__next__

        def __init__(loader, *args, **kwargs):
            original_init(loader, *args, **kwargs)
            try:
                watch._sites[loader] = watch.locator.locate(2)
            except TypeError:  # a loader that refuses weak references: no line
                pass

        def __iter__(loader):
            iterator = original_iter(loader)
            if isinstance(iterator, _dataloader._BaseDataLoaderIter) and \
                    getattr(iterator, _RECORD_ATTR, None) is None:
                setattr(iterator, _RECORD_ATTR, watch._new_record(loader, iterator))
            return iterator

        def __next__(iterator):
            record = iterator.__dict__.get(_RECORD_ATTR)
            if record is None:  # an iterator made without DataLoader.__iter__
                record = watch._new_record(None, iterator)
                setattr(iterator, _RECORD_ATTR, record)
            start_ns = watch.clock()
            try:
                data = original_next(iterator)
            except StopIteration:
                record.workers.sample(iterator, watch.clock(), force=True)
                raise
            try:
                watch._arrived(record, iterator, data, start_ns, watch.clock())
            except Exception:  # noqa: BLE001 - the script's batch matters more
                record.problems += 1
            return data

        for owner, name, wrapper in ((DataLoader, "__init__", __init__),
                                     (DataLoader, "__iter__", __iter__),
                                     (_dataloader._BaseDataLoaderIter, "__next__", __next__)):
            self._saved.append((owner, name, owner.__dict__[name]))
            wrapper.__wrapped__ = owner.__dict__[name]
            setattr(owner, name, wrapper)

    def uninstall(self) -> None:
        self._close_window()
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved = []

    def forward_begins(self) -> None:
        """The batch has been moved (a root module's forward begins): stop looking at
        copies, so that the model's own ``.to`` calls cost nothing more."""
        if self._copy_saved:
            self._close_window()

    # --- recording -----------------------------------------------------------------------
    def _new_record(self, loader, iterator) -> LoaderRecord:
        known = self._by_loader.get(loader) if loader is not None else None
        if known is not None:
            return known
        source = self._sites.get(loader) if loader is not None else None
        record = LoaderRecord(_settings(loader, iterator),
                              source or self.locator.locate(3))
        self.records.append(record)
        if loader is not None:
            try:
                self._by_loader[loader] = record
            except TypeError:
                pass
        return record

    def _arrived(self, record: LoaderRecord, iterator, data, start_ns: int,
                 end_ns: int) -> None:
        tensors = _batch_tensors(data)
        size = pinned = 0
        seen = set()
        for tensor in tensors:
            nbytes, key = _storage_bytes(tensor)
            if key in seen:
                continue
            seen.add(key)
            size += nbytes
            if tensor.device.type == "cpu" and _is_pinned(tensor):
                pinned += nbytes
        record.batches.append((start_ns, end_ns - start_ns, size, pinned))
        if record.settings.get("batch_size") is None and tensors and tensors[0].dim():
            record.settings["batch_size_seen"] = int(tensors[0].shape[0])
        record.workers.sample(iterator, end_ns)
        self._window = record
        self._pending = {id(t): weakref.ref(t) for t in tensors}
        self._open_window()

    def _copied(self, source, target_device, non_blocking: bool, skip: int = 3) -> None:
        """A copy of ``source`` to ``target_device`` was asked for in the window."""
        record = self._window
        if record is None or target_device is None or isinstance(source, torch.nn.Parameter):
            return
        ref = self._pending.get(id(source))
        from_batch = ref is not None and ref() is source
        on_host = source.device.type == "cpu"
        if not from_batch and not (on_host and torch.device(target_device).type != "cpu"
                                   and not source.requires_grad):
            return
        record.copies.append((
            self.clock(), source.numel() * source.element_size(), str(target_device),
            bool(non_blocking), on_host and _is_pinned(source), from_batch,
            self.locator.locate(skip)[:2]))

    def _open_window(self) -> None:
        if self._copy_saved:
            return
        watch = self
        tensor = torch.Tensor
        original_to, original_cuda, original_copy = tensor.to, tensor.cuda, tensor.copy_

        def to(self, *args, **kwargs):
            result = original_to(self, *args, **kwargs)
            try:
                device, _, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
                watch._copied(self, device, non_blocking)
            except Exception:  # noqa: BLE001 - never fail the script's copy
                pass
            return result

        def cuda(self, device=None, non_blocking=False, **kwargs):
            result = original_cuda(self, device, non_blocking, **kwargs)
            try:
                watch._copied(self, result.device, non_blocking)
            except Exception:  # noqa: BLE001 - never fail the script's copy
                pass
            return result

        def copy_(self, src, non_blocking=False):
            result = original_copy(self, src, non_blocking)
            try:
                if isinstance(src, torch.Tensor):
                    watch._copied(src, self.device, non_blocking)
            except Exception:  # noqa: BLE001 - never fail the script's copy
                pass
            return result

        for name, wrapper, original in (("to", to, original_to), ("cuda", cuda, original_cuda),
                                        ("copy_", copy_, original_copy)):
            wrapper.__wrapped__ = original
            self._copy_saved.append((tensor, name, tensor.__dict__.get(name)))
            setattr(tensor, name, wrapper)

    def _close_window(self) -> None:
        for owner, name, original in reversed(self._copy_saved):
            if original is None:
                delattr(owner, name)  # inherited from TensorBase: fall back to it
            else:
                setattr(owner, name, original)
        self._copy_saved = []
        self._window = None
        self._pending = {}

    # --- output --------------------------------------------------------------------------
    def describe(self, boundary_ns: list[int]) -> list[dict]:
        """One entry per DataLoader iterated (the iterators of its epochs together)."""
        return [record.describe(list(boundary_ns)) for record in self.records]


def _settings(loader, iterator) -> dict:
    """The loader's settings, as asked (``pin_memory``) and as done (``pin_memory_used``:
    torch pins only where an accelerator is present)."""
    source = loader if loader is not None else iterator
    workers = int(getattr(loader, "num_workers", getattr(iterator, "_num_workers", 0)) or 0)
    settings = {
        "class": type(loader).__name__ if loader is not None else type(iterator).__name__,
        "num_workers": workers,
        "prefetch_factor": getattr(source, "prefetch_factor",
                                   getattr(iterator, "_prefetch_factor", None)) if workers
        else None,
        "pin_memory": bool(getattr(loader, "pin_memory", getattr(iterator, "_pin_memory",
                                                                 False))),
        "pin_memory_used": bool(getattr(iterator, "_pin_memory", False)),
        "persistent_workers": bool(getattr(loader, "persistent_workers", False)),
        "batch_size": getattr(loader, "batch_size", None),
        "drop_last": bool(getattr(loader, "drop_last", False)),
    }
    if settings["batch_size"] is None:
        sampler = getattr(iterator, "_index_sampler", None)
        size = getattr(sampler, "batch_size", None)
        settings["batch_size"] = size if isinstance(size, int) else None
    if settings["pin_memory"] and not settings["pin_memory_used"]:
        settings["pinning"] = ("pin_memory=True asked, not done: no accelerator on the "
                               "profiling machine (torch pins only where one is present)")
    return settings


def _batch_tensors(data) -> list:
    found, stack = [], [data]
    while stack and len(found) < _MAX_BATCH_TENSORS:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
        elif isinstance(item, Mapping):
            stack.extend(reversed(list(item.values())))
    return found


def _storage_bytes(tensor) -> tuple[int, object]:
    try:
        storage = tensor.untyped_storage()
        return int(storage.nbytes()), (tensor.device.type, storage.data_ptr())
    except (RuntimeError, NotImplementedError):  # no storage to look at (a subclass)
        return tensor.numel() * tensor.element_size(), id(tensor)


def _is_pinned(tensor) -> bool:
    try:
        return bool(tensor.is_pinned())
    except RuntimeError:
        return False


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _host_memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0
