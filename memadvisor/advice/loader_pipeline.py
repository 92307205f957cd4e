"""Data-loading advice from what the profiler recorded about each DataLoader (the trace's
``data_loaders`` metadata, docs/TRACE.md): the time the step waited for its batch, the
host memory of the batches in flight and of the worker processes, and what the script's
copies already do (``pin_memory``, ``non_blocking``).

Batches in flight: a DataLoader with W workers keeps up to W x prefetch_factor batches
requested ahead (in the workers, in shared memory, or -- with ``pin_memory`` -- copied into
page-locked memory by the pin thread, the shared-memory original freed once copied), and
the main process holds the one it is training on: (W x prefetch_factor + 1) x the batch's
host bytes.  Without workers it is the one batch.  Modelled from the recorded settings and
batch bytes; the workers' own memory beside it is measured (best effort, sampled).
"""
from __future__ import annotations

from ..units import format_bytes
from . import INFO, SUGGESTED, Advice

KIND = "data_loading"
#: a loader wait above this share of the step is worth more workers
WAIT_SHARE = 0.1
#: below this share the workers are ahead of the step (room to hold fewer batches)
AHEAD_SHARE = 0.05
#: the pipeline's host memory above this share of the machine's is worth shrinking
LARGE_HOST_SHARE = 0.1


def loader_of_step(loaders: list[dict], step: int | None) -> tuple[dict | None, dict]:
    """The loader that fed the analysed step (most batches in it) and its entry for that
    step; else the loader with the most batches and an empty entry."""
    best, best_entry = None, {}
    for loader in loaders:
        entry = next((s for s in loader.get("steps") or [] if s.get("index") == step), None)
        if entry and entry.get("batches") and \
                entry["batches"] > (best_entry.get("batches") or 0):
            best, best_entry = loader, entry
    if best is None and loaders:
        best = max(loaders, key=lambda loader: loader.get("batches") or 0)
    return best, best_entry


def in_flight(loader: dict) -> dict:
    """Batches in flight and their host bytes (modelled from the recorded settings)."""
    workers = int(loader.get("num_workers") or 0)
    prefetch = int(loader.get("prefetch_factor") or 0) if workers else 0
    batches = workers * prefetch + 1
    batch_bytes = int(loader.get("batch_bytes") or 0)
    pinned = batches * batch_bytes if loader.get("pin_memory_used") else 0
    return {"num_workers": workers, "prefetch_factor": prefetch, "batches_in_flight": batches,
            "batch_bytes": batch_bytes, "pipeline_host_bytes": batches * batch_bytes,
            "pinned_host_bytes": pinned}


def workers_memory(loader: dict) -> tuple[int, str]:
    """Measured host bytes of the worker processes together, and which figure it is:
    private (USS) where sampled, else anonymous resident bytes (overstates: pages still
    shared with the parent count)."""
    memory = loader.get("workers_memory") or {}
    if memory.get("max_total_private_bytes"):
        return int(memory["max_total_private_bytes"]), "private (USS)"
    if memory.get("max_total_anonymous_bytes"):
        return int(memory["max_total_anonymous_bytes"]), \
            "anonymous resident (counts pages still shared with the main process)"
    return 0, ""


def loader_wait_advice(loader: dict, entry: dict, step_seconds: float,
                       target_step_seconds: float | None = None,
                       target: str = "") -> Advice | None:
    """The time the analysed step waited in the loader's ``__next__``: more workers where
    it is a large share of the step -- of the target's step where ``target_step_seconds``
    (a CPU trace judged for a GPU: the step modelled there, the wait host work that stays)."""
    if not entry.get("batches"):
        return None
    wait = float(entry.get("wait_s") or 0.0)
    share = wait / step_seconds if step_seconds else 0.0
    workers = int(loader.get("num_workers") or 0)
    cpus = int(loader.get("cpu_count") or 0)
    details = {"loader_wait_seconds": wait, "step_seconds": step_seconds,
               "share_of_step": share, "num_workers": workers, "cpu_count": cpus,
               "batches": int(entry["batches"]), "loader": loader.get("source", "")}
    measured = (f"the step waited {wait * 1e3:.2f} ms for its batch in the DataLoader's "
                f"__next__ ({entry['batches']} batch{'es' if entry['batches'] > 1 else ''}), "
                f"{share:.0%} of the {step_seconds * 1e3:.1f} ms step (measured while "
                "profiling")
    measured += ("; the main process loads the batch itself (num_workers=0), its ops "
                 "tracked by the profiler, slower than unprofiled)" if not workers else ")")
    decisive = share
    if target_step_seconds:
        decisive = wait / (wait + target_step_seconds)
        details.update(target_step_seconds=target_step_seconds, share_of_target_step=decisive)
        measured += (f"; on the {target} the step computes in ~{target_step_seconds * 1e3:.3g} "
                     f"ms (modelled: its FLOPs at the target's rate, at least one 5 us kernel launch "
                     f"per op), so this wait, host work that stays host work, would be "
                     f"{decisive:.0%} of it")
        if workers and target_step_seconds < step_seconds / 2:
            measured += (f" -- and the workers, which had the {step_seconds * 1e3:.1f} ms "
                         "step here to prepare the next batch, would have "
                         f"{step_seconds / target_step_seconds:,.0f}x less time there (not "
                         "known from this trace whether they keep up)")
    if decisive < WAIT_SHARE:
        keeps_up = (f"{workers} worker{'s' if workers != 1 else ''} keep up" if workers
                    else "loading in the main process is a small part of the step")
        return Advice(kind=KIND, status=INFO, seconds=wait, location=loader.get("source", ""),
                      title="input pipeline: the step waits for its batch",
                      reason=measured + "; " + keeps_up, details=details)
    if cpus and workers >= cpus:
        return Advice(kind=KIND, status=INFO, seconds=wait, location=loader.get("source", ""),
                      title="input pipeline: the step waits for its batch",
                      reason=measured + f"; its {workers} workers already match the "
                             f"profiling machine's {cpus} CPUs: the dataset's own work per "
                             "batch (decoding, transforms) is the cost, more workers would "
                             "only help on a machine with more cores",
                      details=details)
    suggested = max(2, 2 * workers)
    if cpus:
        suggested = min(suggested, cpus)
    details["suggested_num_workers"] = suggested
    return Advice(
        kind=KIND, status=SUGGESTED, seconds=wait, location=loader.get("source", ""),
        title=f"DataLoader(num_workers={suggested})"
              + (f" instead of {workers}" if workers else ""),
        reason=measured + f": up to that much of each step is spent waiting for data, which "
               f"{suggested} worker processes preparing batches ahead would hide (the "
               f"profiling machine has {cpus or 'an unknown number of'} CPUs); each worker "
               "costs its own host memory and prefetch_factor batches in flight",
        details=details)


def pipeline_memory_advice(loader: dict, entry: dict, step_seconds: float) -> Advice | None:
    """Host memory of the batches in flight and the workers; fewer of them where that is
    a large share of the machine's memory while the workers are ahead of the step."""
    flight = in_flight(loader)
    if not flight["batch_bytes"]:
        return None
    workers_bytes, figure = workers_memory(loader)
    total = flight["pipeline_host_bytes"] + workers_bytes
    host = int(loader.get("host_memory_bytes") or 0)
    wait = float(entry.get("wait_s") or 0.0)
    share_of_step = wait / step_seconds if step_seconds else 0.0
    W, P = flight["num_workers"], flight["prefetch_factor"]
    details = {**flight, "workers_host_bytes": workers_bytes, "workers_memory_figure": figure,
               "pipeline_and_workers_host_bytes": total, "host_memory_bytes": host,
               "loader_wait_seconds": wait, "loader": loader.get("source", "")}
    terms = (f"{flight['batches_in_flight']} batch{'es' if flight['batches_in_flight'] > 1 else ''}"
             f" in flight ({W} workers x prefetch_factor {P} + 1 in the main process) x "
             f"{format_bytes(flight['batch_bytes'])} = "
             f"{format_bytes(flight['pipeline_host_bytes'])} of host memory"
             if W else f"1 batch in flight (num_workers=0: loaded in the main process) = "
                       f"{format_bytes(flight['pipeline_host_bytes'])} of host memory")
    if flight["pinned_host_bytes"]:
        terms += f", up to {format_bytes(flight['pinned_host_bytes'])} of it page-locked " \
                 "(pin_memory)"
    elif loader.get("pin_memory"):
        terms += " (pin_memory=True asked, not done on the profiling machine: on a GPU " \
                 "machine up to all of it page-locked)"
    if W:
        terms += (f"; the {W} workers' own memory {format_bytes(workers_bytes)} ({figure}, "
                  "sampled)" if workers_bytes else "; the workers' memory was not sampled")
    large = host and total >= LARGE_HOST_SHARE * host
    if not (W and large and share_of_step < AHEAD_SHARE):
        return Advice(kind=KIND, status=INFO, location=loader.get("source", ""),
                      title=f"input pipeline host memory: {format_bytes(total)}",
                      reason=terms + (f", {total / host:.0%} of the machine's "
                                      f"{format_bytes(host)}" if host else ""),
                      details=details)
    per_worker = workers_bytes // W if W else 0
    fewer = max(1, W // 2)
    save_fewer = (W - fewer) * (P * flight["batch_bytes"] + per_worker)
    save_prefetch = W * (P - 1) * flight["batch_bytes"] if P > 1 else 0
    if save_prefetch >= save_fewer:
        title, saved = f"DataLoader(prefetch_factor=1) instead of {P}", save_prefetch
    else:
        title, saved = f"DataLoader(num_workers={fewer}) instead of {W}", save_fewer
    details.update(host_bytes_saved=saved, prefetch_one_saves_bytes=save_prefetch,
                   fewer_workers=fewer, fewer_workers_save_bytes=save_fewer)
    return Advice(
        kind=KIND, status=SUGGESTED, location=loader.get("source", ""),
        title=f"{title}: frees ~{format_bytes(saved)} of host memory",
        reason=(terms + f": {format_bytes(total)}, {total / host:.0%} of the machine's "
                f"{format_bytes(host)}, while the step waited only {wait * 1e3:.2f} ms "
                f"({share_of_step:.0%}) for data -- the workers are ahead.  prefetch_factor=1 "
                f"frees {format_bytes(save_prefetch)}, num_workers={fewer} "
                f"{format_bytes(save_fewer)} (their batches and own memory); check the wait "
                "stays small"),
        details=details)


def copies_done(loader: dict | None, entry: dict, link_bytes_s: float,
                min_seconds: float) -> dict:
    """What the script's copies already do, from the recorded copies of the analysed
    step: pinned (``pin_memory=True`` asked counts, done or not) and ``non_blocking``,
    each 'done' when what is left undone copies in less than ``min_seconds``."""
    if loader is None:
        return {"recorded": False, "pinned": False, "non_blocking": False}
    copied = int(entry.get("copy_bytes") or 0)
    blocking = copied - int(entry.get("non_blocking_copy_bytes") or 0)
    pageable = copied - int(entry.get("pinned_copy_bytes") or 0)
    small = (lambda n: n / link_bytes_s < min_seconds) if link_bytes_s else (lambda n: n == 0)
    return {"recorded": True, "copy_bytes": copied, "blocking_copy_bytes": blocking,
            "pageable_copy_bytes": pageable,
            "pinned": bool(loader.get("pin_memory")) or (copied > 0 and small(pageable)),
            "non_blocking": copied > 0 and small(blocking)}


def largest_copy_site(loader: dict | None) -> str:
    sites = (loader or {}).get("copies") or []
    if not sites:
        return ""
    return max(sites, key=lambda site: site.get("bytes") or 0).get("source", "")
