"""Run a user's training script as ``__main__`` under a ProfileSession; always keep a trace.

The script sees what ``python train.py ARGS`` would give it: ``sys.argv``, ``sys.path[0]``
set to its folder, ``__file__``, ``__name__ == "__main__"``, the caller's working
directory.  Whatever happens -- the requested steps done, the script ending, raising,
timing out, Ctrl-C or SIGTERM -- the events recorded so far are written.
"""
from __future__ import annotations

import os
import signal
import sys
import traceback
import types
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from ..output_files import check_output
from ..trace.analysis import live_bytes
from ..trace.io import write_trace
from .checkpoint import Checkpoint
from .crash import CrashWitness as _CrashWitness, SignalsHeld as _SignalsHeld, \
    give_children_sigterm, real_exit, stop_giving_children_sigterm
from .session import NATIVE_UNAVAILABLE, ProfileSession, StopProfiling

EXIT_SCRIPT_ERROR = 1
EXIT_TIMEOUT = 124
EXIT_INTERRUPTED = 130


@dataclass
class ProfileResult:
    trace_path: Path
    status: str  #: completed | error | interrupted | timeout
    exit_code: int
    steps_completed: int
    events: int
    peak_bytes: int
    error: str = ""
    traceback: str = ""
    write_error: str = ""  #: the trace could not be written (and what was kept instead)
    engine_note: str = ""  #: why the run fell back to the slower dispatch engine


def rank_output_path(output: str | os.PathLike) -> Path:
    """Rank 0 writes OUTPUT; rank R>0 writes OUTPUT with '.rankR' before the suffix."""
    path = Path(output)
    rank = int(os.environ.get("RANK", "0") or 0)
    if rank <= 0:
        return path
    return path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


def _compile_script(script: Path):
    if not script.exists():
        raise UserError(f"{script}: no such script")
    if script.is_dir():
        raise UserError(f"{script}: is a directory, expected a Python script")
    try:
        source = script.read_bytes()
    except OSError as exc:
        raise UserError(f"{script}: cannot read ({exc.strerror})") from None
    try:
        return compile(source, str(script), "exec", dont_inherit=True)
    except SyntaxError as exc:
        where = f"{script}:{exc.lineno}" if exc.lineno else str(script)
        raise UserError(f"{where}: SyntaxError: {exc.msg} (nothing was run)") from None


class _ScriptContext:
    """Swap in the script's argv, sys.path[0] and __main__ module; restore on exit."""

    def __init__(self, script: Path, args: list[str]):
        self.script = script
        self.args = args

    def __enter__(self) -> dict:
        self._argv, self._path0 = sys.argv, sys.path[0] if sys.path else None
        self._main = sys.modules.get("__main__")
        sys.argv = [str(self.script), *self.args]
        folder = str(self.script.resolve().parent)
        if sys.path:
            sys.path[0] = folder
        else:
            sys.path.insert(0, folder)
        module = types.ModuleType("__main__")
        module.__file__ = str(self.script)
        module.__builtins__ = __builtins__
        module.__cached__ = None
        sys.modules["__main__"] = module
        self._sigterm = None
        if _in_main_thread():
            # SIGTERM (a scheduler, torchrun tearing down) behaves like Ctrl-C: trace kept
            self._sigterm = signal.signal(signal.SIGTERM, _raise_interrupt)
            give_children_sigterm(_raise_interrupt, self._sigterm)
        return module.__dict__

    def __exit__(self, *exc):
        sys.argv = self._argv
        if self._path0 is not None and sys.path:
            sys.path[0] = self._path0
        if self._main is not None:
            sys.modules["__main__"] = self._main
        if self._sigterm is not None:
            signal.signal(signal.SIGTERM, self._sigterm)
            stop_giving_children_sigterm()


def _in_main_thread() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _user_traceback(exc: BaseException) -> str:
    """The script's traceback without memadvisor's own frames."""
    package = str(Path(__file__).resolve().parents[1])
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not str(Path(f.filename).resolve()).startswith(package)]
    text = "".join(traceback.format_list(frames))
    text += "".join(traceback.format_exception_only(type(exc), exc))
    return text


def _one_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0].strip()}" if lines else type(exc).__name__


def _warm_up_imports() -> None:
    """Import what torch loads lazily on first use (dynamo: ~1-2 s) before timing starts,
    so step 0's duration is the script's, not an import's."""
    try:
        import torch._dynamo  # noqa: F401
    except Exception:  # pragma: no cover - a torch without dynamo
        pass


def profile_script(script: str | os.PathLike, args: list[str] | None = None,
                   output: str | os.PathLike = "memadvisor.trace", *, steps: int | None = 3,
                   timeout_s: float | None = None, step_boundary: str = "auto",
                   on_step=None, engine: str | None = None,
                   probes: bool = True, extension=None,
                   exit_when_stop_swallowed: bool = False) -> ProfileResult:
    """Profile ``script`` for ``steps`` steps and write the trace (always).

    ``extension`` (fake execution's, ``fake_run.FakeProfile``) adapts the run to another
    execution: ``session_options()`` (extra ProfileSession arguments), ``attach(session)``
    before the script runs, ``explain(status, error, exc)`` -> (error, traceback) for a
    run that did not complete, ``finish(meta)`` before the trace is written, and
    ``output_path(output)`` instead of the per-rank name.

    A script that catches the stop after the requested steps (a bare ``except:``) and runs
    on is stopped again at its next forward or optimizer step; with
    ``exit_when_stop_swallowed`` (the ``profile`` command) the trace is written there and
    the process ends with status 0 -- a ``while True`` loop would otherwise never end."""
    script = Path(script)
    args = list(args or [])
    code = _compile_script(script)
    output = extension.output_path(output) if extension else rank_output_path(output)
    # before the run, and absolute: a script that chdir's must not move it
    output = check_output(output, "trace")
    _warm_up_imports()
    options = {"engine": engine, "probes": probes,
               **(extension.session_options() if extension else {})}
    if (options["engine"] or os.environ.get("MEMADVISOR_ENGINE")) == "native":
        from .native_engine import available
        ok, reason = available()
        if not ok:
            raise UserError(f"the native engine cannot run here: {reason}")
    session = ProfileSession(steps=steps, step_boundary=step_boundary, timeout_s=timeout_s,
                             script=str(script.resolve()), on_step=on_step, **options)
    if extension:
        extension.attach(session)
    checkpoint = None
    if extension is None:  # (fake execution writes from a child its parent watches)
        checkpoint = session.checkpoint = Checkpoint(Path(output), str(script), args)
    held = _SignalsHeld(output)
    if exit_when_stop_swallowed:
        def end_the_run() -> None:
            held.hold()
            _, meta, write_error = _write_final(session, extension, output, script, args,
                                                "completed", "")
            steps = meta.steps_completed if meta else 0
            print(f"memadvisor: the script caught the stop after its {steps} steps (a bare "
                  f"`except:`?) and ran on; " + (
                      f"wrote {output}, ending it" if not write_error else
                      f"could not write {output} ({write_error})"), file=sys.stderr, flush=True)
            sys.stdout.flush()
            real_exit(0 if not write_error else EXIT_SCRIPT_ERROR)
        session.on_stop_swallowed = end_the_run
    with _ScriptContext(script, args) as namespace, _CrashWitness(session, script, args, output):
        outcome: BaseException | None = None
        try:
            with session:
                exec(code, namespace)
        except BaseException as exc:
            # first: a second Ctrl-C (or SIGTERM) from here on must not lose the trace
            held.hold()
            outcome = exc
            del exc
        finally:
            held.hold()
            try:
                status, exit_code, error, tb = _outcome(outcome, session, timeout_s, extension)
                outcome = None
                table, meta, write_error = _write_final(
                    session, extension, output, script, args, status, error)
            finally:
                held.release()
    if write_error:
        return ProfileResult(trace_path=output, status=status, exit_code=exit_code or 1,
                             steps_completed=checkpoint.written_steps if checkpoint else 0,
                             events=0, peak_bytes=0, error=error, traceback=tb,
                             write_error=_kept_message(write_error, output, checkpoint))
    # the peak as every reader of the trace counts it (storages alive before recording
    # included), so the line profile prints agrees with `summary`
    live = live_bytes(table.select(["size_bytes", "action"]).to_pandas())
    reason = session.engine_status
    return ProfileResult(trace_path=output, status=status, exit_code=exit_code,
                         steps_completed=meta.steps_completed, events=table.num_rows,
                         peak_bytes=int(live.max()) if len(live) else 0, error=error,
                         traceback=tb, engine_note=reason
                         if reason.startswith(NATIVE_UNAVAILABLE) else "")


def _outcome(exc: BaseException | None, session, timeout_s, extension):
    """How the script's run ended -> (status, exit code, one-line error, traceback)."""
    if exc is None or isinstance(exc, StopProfiling):
        return "completed", 0, "", ""
    if isinstance(exc, SystemExit):
        if exc.code in (None, 0):
            return "completed", 0, "", ""
        exit_code = exc.code if isinstance(exc.code, int) else EXIT_SCRIPT_ERROR
        return "error", exit_code, f"the script called sys.exit({exc.code!r})", ""
    tb = ""
    if isinstance(exc, KeyboardInterrupt):
        if session.timed_out:
            done = len(session.boundaries()[1])
            status, exit_code = "timeout", EXIT_TIMEOUT
            error = (f"no step completed within {timeout_s:g} s "
                     f"(after {done} step{'s' if done != 1 else ''})")
        else:
            status, exit_code, error = "interrupted", EXIT_INTERRUPTED, "interrupted"
    else:  # the script's own error: keep the trace, report it
        status, exit_code = "error", EXIT_SCRIPT_ERROR
        error, tb = _one_line(exc), _user_traceback(exc)
    if extension:
        error, tb = extension.explain(status, error, exc)
    return status, exit_code, error, tb


def _write_final(session, extension, output, script, args, status, error):
    """Close the session and write the trace; -> (table, meta, "") or (None, None, why it
    could not be written) -- after a MemoryError, pyarrow may not even start a thread."""
    try:
        session.close()
        # probes measure kernels after the run: not worth a wait after a Ctrl-C
        table, meta = session.build(script=str(script), args=args, status=status,
                                    error=error, probes=status not in ("interrupted", "timeout"))
        if extension:
            extension.finish(meta)
        write_trace(output, table, meta)
        return table, meta, ""
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - the script's own outcome must still be told
        return None, None, _one_line(exc)


def _kept_message(write_error: str, output: Path, checkpoint) -> str:
    if checkpoint is not None and checkpoint.written_steps:
        steps = checkpoint.written_steps
        return (f"could not write the final trace ({write_error}); {output} holds the trace "
                f"as of step {steps}, written during the run")
    return f"could not write the trace to {output} ({write_error}); nothing was kept"
