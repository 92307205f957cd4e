"""What each rank runs under torchrun: the script (or its profile), then a clean exit.

    python -m memadvisor.apply.rank_main [--profile OUT] [--profile-steps N]
        [--save-parameters FILE] -- SCRIPT [ARGS...]

A failure is written to torch elastic's error file (``ErrorHandler.record_exception``) so
the launcher can say which rank failed and why; a memadvisor error (a plan the batch
cannot be split for, say) is one line, the script's own exception keeps its traceback.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path


def parse(argv):
    parser = argparse.ArgumentParser(prog="python -m memadvisor.apply.rank_main")
    parser.add_argument("--profile", type=Path)
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--save-parameters", type=Path)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--timeout", type=float)
    parser.add_argument("script", type=Path)
    parser.add_argument("args", nargs=argparse.REMAINDER)
    if "--" in argv:
        split = argv.index("--")
        options = parser.parse_args([*argv[:split], *argv[split + 1: split + 2]])
        options.args = argv[split + 2:]
        return options
    return parser.parse_args(argv)


def die_with_parent() -> None:
    """End this rank when the process that launched it dies, however it dies (a ``kill
    -9`` of ``memadvisor apply`` leaves no one to stop the ranks, which run in their own
    sessions): Linux's parent-death signal.  Elsewhere nothing is done."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal
    pr_set_pdeathsig = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the launcher died before the signal was armed
        os._exit(143)


def _interrupt_once(signum, frame) -> None:
    """The first Ctrl-C the launcher passes on: further ones are ignored *before* the
    KeyboardInterrupt unwinds the script.  torchrun may send the signal again while this
    rank winds down; one landing in a weakref callback of the objects the unwinding frees
    prints an "Exception ignored ... KeyboardInterrupt" traceback on the user's terminal
    (ignoring it only in the except clause below left that window open)."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def main(argv=None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    die_with_parent()
    import signal
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupt_once)

    from ..errors import UserError
    from . import launch

    options = parse(sys.argv[1:] if argv is None else argv)
    handler = get_error_handler()
    handler.initialize()
    rank = os.environ.get("RANK", "0")
    try:
        launch.run_in_process(options.script, options.args, options.profile,
                              options.profile_steps, options.save_parameters, options.steps,
                              options.timeout)
    except KeyboardInterrupt:  # the launcher passes on a Ctrl-C: it says so, once
        # torchrun may send the signal again while this rank winds down; raised inside the
        # weakref callbacks of the collection below, it would print "Exception ignored ...
        # KeyboardInterrupt" tracebacks on the user's terminal
        import signal
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        return 130
    except UserError as exc:
        print(f"[rank{rank}] memadvisor: error: {exc}", file=sys.stderr, flush=True)
        handler.record_exception(exc)
        return exc.exit_code
    except Exception as exc:  # a bug in memadvisor itself: keep the traceback
        import traceback
        traceback.print_exc()
        handler.record_exception(exc)
        return 1
    finally:
        gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
