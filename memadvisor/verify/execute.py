"""Execute a plan and measure what it allocates: the prediction that holds by construction.

The script a trace recorded is rewritten for the plan by ``apply``'s own rewrite (the code
``memadvisor apply`` writes and runs, the runtime included) and then executed:

* **GPU targets: fake execution** (``profile --fake``): every tensor fake, on the
  simulated GPU, each rank run as rank R of the plan's world on a fake process group (FSDP
  and DDP really shard, gather and reduce); the executed trace's device rows go through
  the caching-allocator model from a fresh process.  Rank 0 and the last rank run (the
  last holds FSDP's uneven shard remainders and the last data shard); ``ranks`` chooses.
* **The CPU target: the real run** at the recorded size (``memadvisor apply --profile``,
  torchrun on gloo for several ranks): fake CPU tensors would miss what CPU kernels
  allocate besides tensors (oneDNN scratch), which a real run measures.

Both analyse the same step the analytic prediction does: the executed run's last complete
step (its peak allocated; for a GPU, the model's reserved bytes at that step's end, every
earlier step's segments still cached, as ``max_memory_reserved`` would say).
"""
from __future__ import annotations

import contextlib
import heapq
import itertools
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError
from ..plan import Plan
from .script import RecordedScript, applied_copy, in_user_terms, rewritten
from .shallow_runs import light_layer_classes, run_shallow, runs_shallow

#: steps a verification runs at most (the peak of a training step is reached by the
#: second: the optimizer's state exists from the first step on)
MAX_STEPS = 3
#: a fake step that takes longer than this is stopped (a loop the placeholders never end)
FAKE_STEP_TIMEOUT_S = 600.0


@dataclass(kw_only=True, slots=True)
class RankPeaks:
    rank: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int | None  #: the allocator model's; None on the CPU
    steps_completed: int

    @property
    def peak_bytes(self) -> int:
        """What must fit: reserved where an allocator caches, else allocated."""
        return self.peak_reserved_bytes if self.peak_reserved_bytes is not None \
            else self.peak_allocated_bytes


@dataclass(kw_only=True)
class Verification:
    plan: Plan
    method: str  #: 'fake' (fake tensors on the simulated GPU) or 'real' (this CPU)
    where: str  #: how it ran, in words
    ranks: list[RankPeaks] = field(default_factory=list)
    refused: str | None = None  #: apply cannot realise the plan for this script: why
    failed: str | None = None  #: the executed run failed: its one line
    warnings: list[str] = field(default_factory=list)
    seconds: float = 0.0
    """Wall time executing (the rewrite and the runs; not the wait for a free core)."""
    waited_s: float = 0.0
    """Wall time its runs waited for a core, running side by side with other plans."""

    @property
    def executed(self) -> bool:
        return bool(self.ranks) and not self.refused and not self.failed

    @property
    def worst(self) -> RankPeaks | None:
        """The rank that needs the most memory (what every GPU must hold)."""
        return max(self.ranks, key=lambda r: (r.peak_bytes, -r.rank), default=None)


def verify_plan(script: RecordedScript, meta, plan: Plan, hw, *, ranks=None,
                steps: int | None = None, method: str | None = None,
                slots: ChildSlots | None = None, server=None,
                depth: str = "auto") -> Verification:
    """Run ``plan`` on ``script`` (as ``memadvisor apply`` would) and measure its peaks.
    ``method``: 'fake' or 'real' (the CPU target only); default fake on a GPU, real on
    the CPU.  ``slots``, ``server`` (``profile_fake.ChildServer``: fake runs fork from it):
    shared by plans verified side by side (default: this plan's own).  ``depth``: 'auto'
    runs a deep model's plan as shallow runs on a simulated GPU (``shallow_runs.py``),
    'full' at the script's own depth."""
    started = time.monotonic()
    method = method or ("fake" if hw.device_type == "cuda" else "real")
    if method == "real" and hw.device_type != "cpu":
        raise UserError(f"a real run can only verify the cpu target (this machine), not "
                        f"{hw.name}: use fake execution")
    steps = steps or max(1, min(int(meta.steps_completed or MAX_STEPS), MAX_STEPS))
    code, refused = rewritten(script, plan)
    if refused:
        return Verification(plan=plan, method=method, where="not run", refused=refused)
    with applied_copy(script, code) as copy:
        if method == "fake":
            with contextlib.ExitStack() as own:
                if server is None and hw.device_type == "cuda":  # fake CPU runs: no shim
                    from ..commands.profile_fake import ChildServer
                    server = own.enter_context(ChildServer())
                shallow = runs_shallow(meta, depth, hw.device_type == "cuda") and \
                    plan.pp == 1  # pipeline stages split the stack by its depth
                result = _fake(script, copy, plan, hw, steps, ranks,
                               slots or ChildSlots(os.cpu_count() or 1), server,
                               recorded_values(meta), shallow, light_layer_classes(meta))
        else:
            result = _real(script, copy, plan, steps)
        # messages name the user's script and its lines, not the hidden copy that ran
        plain = lambda text: text and in_user_terms(text, copy, script, code)  # noqa: E731
        result.failed = plain(result.failed)
        result.warnings = sorted({plain(w) for w in result.warnings})
    result.seconds = time.monotonic() - started - result.waited_s
    return result


class ChildSlots:
    """At most ``count`` fake-execution children at once (each keeps a core busy); a
    freed slot goes to the costliest waiting child, so that long runs (accumulation's
    micro-batches) start first and short ones fill the gaps.  ``reserve`` queues a run
    before its plan is rewritten, so that a cheap plan rewritten first cannot take the
    first cores from a costly one."""

    def __init__(self, count: int):
        self._free = max(1, count)
        self._waiting: list[tuple[float, int]] = []  # heap of (-cost, arrival)
        self._arrivals = itertools.count()
        self._reserved: dict[tuple, tuple[float, int]] = {}  # key -> its waiting entry
        self._condition = threading.Condition()

    def reserve(self, key: tuple, cost: float) -> None:
        """Queue the run ``key`` (``slot(cost, key)`` takes this place) now."""
        with self._condition:
            entry = self._reserved[key] = (-cost, next(self._arrivals))
            heapq.heappush(self._waiting, entry)

    def cancel(self, keys) -> None:
        """Give up the places of reserved runs that will not start (a refused plan)."""
        with self._condition:
            for key in keys:
                entry = self._reserved.pop(key, None)
                if entry is not None:
                    self._waiting.remove(entry)
            heapq.heapify(self._waiting)
            self._condition.notify_all()

    @contextlib.contextmanager
    def slot(self, cost: float, key: tuple | None = None):
        with self._condition:
            entry = self._reserved.pop(key, None) if key is not None else None
            if entry is None:
                entry = (-cost, next(self._arrivals))
                heapq.heappush(self._waiting, entry)
            while not self._free or self._waiting[0] != entry:
                self._condition.wait()
            heapq.heappop(self._waiting)
            self._free -= 1
            self._condition.notify_all()  # the next in line may take a core still free
        try:
            yield
        finally:
            with self._condition:
                self._free += 1
                self._condition.notify_all()


def plan_cost(plan: Plan) -> float:
    """A plan's fake execution time relative to the unmodified script's (per rank): each
    micro-batch runs every op of the step again, checkpointing recomputes the forward."""
    return plan.accum * (1.0 if plan.checkpoint == "none" else 1.3)


def ranks_to_run(world: int, ranks=None) -> list[int]:
    """Rank 0 and the last, or the ranks asked for (each checked against the world)."""
    if ranks is None:
        return sorted({0, world - 1})
    chosen = sorted(set(ranks))
    bad = [r for r in chosen if not 0 <= r < world]
    if bad:
        raise UserError(f"rank {bad[0]} is not a rank of the plan's world={world}")
    return chosen


# --- GPU targets: fake execution --------------------------------------------------------
def recorded_values(meta) -> dict:
    """What the profiled run's values decided, for a fake run of its script: lengths of
    value-dependent results and scalar reads, by line (``profile/value_sizes.py``)."""
    extra = meta.extra or {}
    return {"value_sizes": extra.get("value_sizes"), "value_reads": extra.get("value_reads")}


def _fake(script: RecordedScript, copy: Path, plan: Plan, hw, steps: int, ranks,
          slots: ChildSlots, server, recorded: dict | None = None,
          shallow: bool = False, light_layers: list[str] | None = None) -> Verification:
    """``recorded``: the profiled run's value-dependent lengths and scalar reads by line
    (:func:`recorded_values`), answered to the fake run (``fake/recorded_sizes.py``);
    ``shallow``: each rank runs as shallow runs where they hold (``shallow_runs.py``),
    the ``light_layers`` classes past the kept ones built on the meta device."""
    from ..commands.profile_fake import run_child
    from ..gpus import gpu_profile
    gpu = gpu_profile(hw.name) if hw.device_type == "cuda" else None
    chosen = ranks_to_run(plan.world, ranks)
    of = f" of {plan.world}" if plan.world > 1 else ""
    names = " and ".join(str(r) for r in chosen) if len(chosen) <= 2 else \
        ", ".join(str(r) for r in chosen)
    device = f"a simulated {gpu.device_name}" if gpu else \
        "the CPU (kernel blocks measured op by op)"
    ranks_text = (f", rank{'s' if len(chosen) > 1 else ''} {names}{of}"
                  if plan.world > 1 else "")
    where = f"fake tensors on {device}{ranks_text}, {steps} step{'s' if steps > 1 else ''}"
    verification = Verification(plan=plan, method="fake", where=where)
    if gpu is None:
        # measured, not assumed (docs/ACCURACY.md, session 17): over the zoo's 159 cases the
        # fake CPU run was within 0.5% of the real one in all, worst +0.16%, none under by
        # more than 0.15%
        verification.warnings.append(
            "fake execution on the CPU measures each op's kernel blocks on this machine; "
            "over the script zoo it was within 0.5% of the real run in all 159 cases, "
            "at worst 0.16% over it (docs/ACCURACY.md); the real run (--verify-by real, "
            "the default on the CPU) is the CPU's own figure")
    with tempfile.TemporaryDirectory(prefix="memadvisor-verify-") as folder:
        def run_rank(rank: int):
            def run_at(keep: int | None):
                output = Path(folder) / f"rank{rank}{f'_cut{keep}' if keep else ''}.trace"
                spec = {"script": str(copy), "args": script.args, "output": str(output),
                        "gpu": gpu.name if gpu else None, "nproc": plan.world, "rank": rank,
                        "steps": steps, "timeout_s": FAKE_STEP_TIMEOUT_S,
                        "step_boundary": "auto", "quiet": True, "keep_layers": keep,
                        "light_layers": light_layers if keep else None, **(recorded or {})}
                try:
                    return run_child(spec, cwd=str(script.cwd), capture=True, server=server)
                except UserError as exc:
                    return exc

            asked = time.monotonic()
            with slots.slot(plan_cost(plan), key=(plan.to_compact(), rank)):
                waits.append(time.monotonic() - asked)
                if not shallow:
                    return run_at(None)
                return run_shallow(
                    run_at, lambda trace: _rank_peaks(trace, rank, plan.world, gpu),
                    lambda trace: _rank_device(trace, rank, plan.world))

        # the ranks are separate processes: they run side by side as cores allow
        waits: list[float] = []
        with ThreadPoolExecutor(max_workers=len(chosen)) as pool:
            results = dict(zip(chosen, pool.map(run_rank, chosen)))
        verification.waited_s = min(waits, default=0.0)
        shallow_note = ""
        for rank in chosen:
            result = results[rank]
            if isinstance(result, UserError):
                verification.failed = f"rank {rank}: {result}"
                return verification
            if "cannot_run" in result:
                verification.failed = f"rank {rank}: {result['cannot_run']}"
                return verification
            if result["status"] != "completed" or result["steps_completed"] < 1:
                verification.failed = (f"rank {rank}: the applied script {result['status']} "
                                       f"after {result['steps_completed']} step(s): "
                                       f"{result.get('error', '')}")
                return verification
            for read in result.get("placeholder_reads", []):
                verification.warnings.append(
                    f"{read['location']} read tensor values "
                    f"({read['op']}): fake execution answered {read['value']}")
            if result.get("shallow_refused"):
                verification.warnings.append(f"ran at full depth: "
                                             f"{result['shallow_refused']}")
            if result.get("peaks"):
                verification.ranks.append(result["peaks"])
                shallow_note = result["shallow"]
                continue
            try:
                verification.ranks.append(_fake_rank_peaks(Path(result["trace_path"]), rank,
                                                           plan.world, gpu))
            except UserError as exc:
                args = f" {' '.join(script.args)}" if script.args else " no arguments"
                verification.failed = (f"rank {rank}: {exc}; it ran with{args} as profiled: "
                                       "a script that picks the CPU by itself or by an "
                                       "argument cannot be verified on a GPU")
                return verification
    if shallow_note:
        verification.where += f"; {shallow_note}"
    return verification


def _fake_rank_peaks(trace_path: Path, rank: int, world: int, gpu) -> RankPeaks:
    from ..trace.io import read_trace
    return _rank_peaks(read_trace(trace_path), rank, world, gpu)


def _rank_peaks(trace, rank: int, world: int, gpu) -> RankPeaks:
    """The analysed step's modelled peaks on the rank's GPU (on the CPU: its recorded
    peak; the CPU's allocator caches nothing)."""
    from ..simulate.allocator_config import parse_alloc_conf
    from ..simulate.recorded_state import model_whole_run
    from ..trace.analysis import analysed_step
    from ..trace.io import Trace
    if gpu is None:
        step = analysed_step(trace)
        return RankPeaks(rank=rank, peak_allocated_bytes=int(trace.meta.steps[step]["peak_bytes"]),
                         peak_reserved_bytes=None, steps_completed=trace.meta.steps_completed)
    device = _rank_device(trace, rank, world)
    events = trace.events[trace.events["device"] == device].reset_index(drop=True)
    step = analysed_step(trace)
    config = parse_alloc_conf((trace.meta.allocator or {}).get("settings", ""))
    run = model_whole_run(Trace(events, trace.meta, trace.path), config,
                          gpu.total_memory_bytes, only_steps=[step])
    allocated, reserved = run.steps.get(step, (0, 0))
    return RankPeaks(rank=rank, peak_allocated_bytes=int(allocated),
                     peak_reserved_bytes=int(reserved),
                     steps_completed=trace.meta.steps_completed)


def _rank_device(trace, rank: int, world: int) -> str:
    """The GPU the rank used: its own index where the script set it, else the one used."""
    used = trace.events.loc[trace.events["device"].astype(str).str.startswith("cuda"), "device"]
    if used.empty:
        raise UserError("the applied script put nothing on the GPU under fake execution")
    expected = f"cuda:{rank % min(world, 8)}"
    counts = used.value_counts()
    return expected if expected in counts.index else str(counts.index[0])


# --- the CPU target: the real run -------------------------------------------------------
def _real(script: RecordedScript, copy: Path, plan: Plan, steps: int) -> Verification:
    from ..trace.analysis import analysed_step
    from ..trace.io import read_trace
    where = (f"real run on this CPU at the recorded size, {plan.world} processes (torchrun, "
             f"gloo), {steps} steps" if plan.world > 1 else
             f"real run on this CPU at the recorded size, {steps} steps")
    verification = Verification(plan=plan, method="real", where=where)
    with tempfile.TemporaryDirectory(prefix="memadvisor-verify-") as folder:
        profile = Path(folder) / "run.trace"
        # apply itself rewrites the original into the hidden copy (beside it, so the
        # script's own imports resolve) and runs it, exactly as a user's `apply` would
        command = [sys.executable, "-m", "memadvisor.cli", "apply", str(script.path), "--plan",
                   plan.to_compact(), "-o", str(copy), "-q", "--nproc", str(plan.world),
                   "--profile", str(profile), "--profile-steps", str(steps), "--",
                   *script.args]
        env = dict(os.environ)
        package_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH"))
                                            if p)
        proc = subprocess.run(command, cwd=str(script.cwd), env=env, capture_output=True,
                              text=True, errors="replace")
        if proc.returncode != 0:
            said = [line for line in proc.stderr.strip().splitlines() if line.strip()]
            last = said[-1].strip() if said else f"exit status {proc.returncode}"
            verification.failed = last.removeprefix("memadvisor: error: ")
            return verification
        for rank in range(plan.world):
            path = profile if rank == 0 else profile.with_name(f"run.rank{rank}.trace")
            if not path.exists():
                verification.failed = f"rank {rank} wrote no trace"
                return verification
            trace = read_trace(path)
            step = analysed_step(trace)
            if step is None:
                verification.failed = f"rank {rank} completed no step"
                return verification
            if (trace.meta.steps_completed or 0) < steps:
                # its last step is another of the step's kinds (a GAN alternates two
                # optimizers) than the one predicted: no figure rather than a wrong one
                verification.failed = (
                    f"rank {rank}'s run ended after {trace.meta.steps_completed} of the "
                    f"{steps} steps profiled (the script stopped sooner under the plan), so "
                    "its analysed step is not the one predicted")
                return verification
            verification.ranks.append(RankPeaks(
                rank=rank, peak_allocated_bytes=int(trace.meta.steps[step]["peak_bytes"]),
                peak_reserved_bytes=None, steps_completed=trace.meta.steps_completed))
    return verification
