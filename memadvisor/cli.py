"""The ``memadvisor`` command.

Each subcommand lives in its own module under ``memadvisor.commands`` and is imported only
when used, so ``memadvisor summary`` never pays for importing torch.  Errors the user can
fix (``UserError``, ``TraceError``) become one line on stderr and a non-zero exit; anything
else is a bug and keeps its traceback.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys

import click

from .errors import TraceError, UserError
from .terminal import safe_text

#: command name -> (module under memadvisor.commands, one-line help)
COMMANDS = {
    "profile": ("profile", "Run a training script for a few steps and record a memory trace."),
    "summary": ("summary", "What fills memory at the peak, and which source line made it."),
    "simulate": ("simulate", "Predict one plan's per-GPU peak memory and step-time cost."),
    "advise": ("advise", "Rank all plans that fit a memory budget."),
    "apply": ("apply", "Rewrite a script to use a plan and run it (torchrun for N ranks)."),
    "report": ("report", "Write a self-contained HTML memory report."),
    "check": ("check", "CI gate: exit 1 when over budget or regressed against a baseline."),
    "compare": ("compare", "What changed between two traces."),
    "ui": ("ui", "Interactive dashboard of the memory timeline and the plans."),
    "import-snapshot": ("import_snapshot",
                        "Turn a CUDA memory snapshot (_dump_snapshot pickle) into a trace."),
    "export-snapshot": ("export_snapshot",
                        "Write a trace as a CUDA memory snapshot for pytorch.org/memory_viz."),
}


def _available(name: str) -> bool:
    return importlib.util.find_spec(f"memadvisor.commands.{COMMANDS[name][0]}") is not None


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return [name for name in COMMANDS if _available(name)]

    def get_command(self, ctx, name):
        if name not in COMMANDS or not _available(name):
            return None
        module = importlib.import_module(f"memadvisor.commands.{COMMANDS[name][0]}")
        return module.command

    def format_commands(self, ctx, formatter):
        rows = [(name, COMMANDS[name][1]) for name in self.list_commands(ctx)]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="memadvisor")
def cli():
    """memadvisor: why does my training step use this much memory, and what makes it fit?"""


def main(argv=None) -> int:
    from .ui.memory import arrow_purges_at_once
    arrow_purges_at_once()  # before a command loads pyarrow (the option is read then)
    try:
        result = cli.main(args=argv, prog_name="memadvisor", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("memadvisor: aborted", err=True)
        return 130
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except (UserError, TraceError) as exc:
        # the message may quote a file's own text: shown, never obeyed by the terminal
        click.echo(safe_text(f"memadvisor: error: {exc}"), err=True)
        return getattr(exc, "exit_code", 2)
    # a command may return its exit status (``check`` returns 1 when over budget)
    return result if isinstance(result, int) else 0


def console_main() -> None:
    """The ``memadvisor`` command: ``main``, then an exit no late Ctrl-C can turn into a
    traceback (the work is done; a user still pressing Ctrl-C wants it to end)."""
    code = main()
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(code)


if __name__ == "__main__":
    console_main()
