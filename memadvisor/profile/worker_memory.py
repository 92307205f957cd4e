"""The host memory of a DataLoader's worker processes, sampled (best effort).

Each batch (at most every 10 ms) reads each worker's resident and anonymous bytes
(psutil's ``memory_info`` where installed, else ``/proc/PID/status``); at most once a
second its private bytes (``/proc/PID/smaps_rollup``'s Private_Clean + Private_Dirty, USS:
what the worker holds that its parent does not share), which cost ~5 ms a read here.  A
forked worker's resident bytes count the parent's pages it still shares copy-on-write, so
they overstate what a worker adds; anonymous bytes too, less so.  Kept: the largest figure
per worker and the largest sum over the workers of one sample.
"""
from __future__ import annotations

_CHEAP_SAMPLE_S = 0.01
_PRIVATE_SAMPLE_S = 1.0

try:  # optional: psutil reads a process's memory without parsing text
    import psutil as _psutil
except ImportError:  # pragma: no cover - psutil is in the test environment
    _psutil = None


class WorkerMemory:
    """The largest memory figures seen per worker process (by worker index)."""

    def __init__(self):
        self.rss: dict[int, int] = {}
        self.anonymous: dict[int, int] = {}
        self.private: dict[int, int] = {}
        self.total_rss = self.total_anonymous = self.total_private = 0
        self.samples = self.private_samples = 0
        self.method = ""
        self.problem = ""
        self._last_ns = self._last_private_ns = None

    def sample(self, iterator, now_ns: int, force: bool = False) -> None:
        workers = getattr(iterator, "_workers", None) or []
        if not workers or (not force and self._last_ns is not None
                           and now_ns - self._last_ns < _CHEAP_SAMPLE_S * 1e9):
            return
        self._last_ns = now_ns
        private = self._last_private_ns is None or \
            now_ns - self._last_private_ns >= _PRIVATE_SAMPLE_S * 1e9
        if private:
            self._last_private_ns = now_ns
        totals = [0, 0, 0]
        for index, worker in enumerate(workers):
            pid = getattr(worker, "pid", None)
            if not pid:
                continue
            try:
                rss, anonymous, self.method = _resident_bytes(pid)
            except (OSError, ValueError) as exc:
                self.problem = f"{type(exc).__name__}: {exc}"[:200]
                continue
            _keep_max(self.rss, index, rss)
            _keep_max(self.anonymous, index, anonymous)
            totals[0] += rss
            totals[1] += anonymous
            if private:
                try:
                    value = _private_bytes(pid)
                except (OSError, ValueError):
                    value = None
                if value is not None:
                    _keep_max(self.private, index, value)
                    totals[2] += value
        self.samples += 1
        self.private_samples += bool(private and totals[2])
        self.total_rss = max(self.total_rss, totals[0])
        self.total_anonymous = max(self.total_anonymous, totals[1])
        self.total_private = max(self.total_private, totals[2])

    def describe(self) -> dict:
        if not self.samples:
            return {"samples": 0, "method": self.method,
                    "problem": self.problem or "no worker was running when sampled"}
        return {
            "method": self.method, "samples": self.samples,
            "private_samples": self.private_samples,
            "max_rss_bytes": _in_order(self.rss), "max_anonymous_bytes": _in_order(self.anonymous),
            "max_private_bytes": _in_order(self.private),
            "max_total_rss_bytes": self.total_rss,
            "max_total_anonymous_bytes": self.total_anonymous,
            "max_total_private_bytes": self.total_private,
            **({"problem": self.problem} if self.problem else {}),
        }


def _resident_bytes(pid: int) -> tuple[int, int, str]:
    """(resident, anonymous) bytes of a process and how they were read."""
    if _psutil is not None:
        try:
            info = _psutil.Process(pid).memory_info()
        except _psutil.Error as exc:
            raise OSError(str(exc)) from None
        shared = getattr(info, "shared", 0)  # Linux: file-backed and shmem pages
        return int(info.rss), int(info.rss - shared), "psutil"
    fields = _proc_fields(f"/proc/{pid}/status", ("VmRSS", "RssAnon"))
    return fields["VmRSS"], fields.get("RssAnon", fields["VmRSS"]), "proc_status"


def _private_bytes(pid: int) -> int | None:
    fields = _proc_fields(f"/proc/{pid}/smaps_rollup", ("Private_Clean", "Private_Dirty"))
    if "Private_Dirty" not in fields:
        return None
    return fields["Private_Dirty"] + fields.get("Private_Clean", 0)


def _proc_fields(path: str, names: tuple[str, ...]) -> dict[str, int]:
    found = {}
    with open(path) as handle:
        for line in handle:
            key, _, value = line.partition(":")
            if key in names:
                found[key] = int(value.split()[0]) * 1024  # kB
    if names[0] not in found:
        raise ValueError(f"{path} has no {names[0]}")
    return found


def _keep_max(values: dict[int, int], index: int, value: int) -> None:
    values[index] = max(values.get(index, 0), value)


def _in_order(values: dict[int, int]) -> list[int]:
    return [values[index] for index in sorted(values)]
