"""Measure the in-place advice: apply it to a copy of a script, profile both, compare.

    python benchmarks/inplace_advice.py SCRIPT [--steps 3] [--keep DIR] [--refused -- ARGS]

Profiles SCRIPT (``memadvisor profile``), reads the in-place advice from its trace
(``memadvisor.advice.inplace``), edits each suggested source line of a copy of the script
(``F.relu(h)`` -> ``F.relu(h, inplace=True)``, ``x = x + y`` -> ``x += y``, ...; a form it
cannot edit is listed and the comparison covers the edits made only when all were made),
profiles the copy, and prints the predicted and the measured drop of the analysed step's
peak.  ``--refused`` also applies each refused change alone and runs the copy: an
autograd refusal shows as a failed run saying "inplace operation".  Exit 1 when a
suggested line could not be edited or the copy's run failed.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

#: activations whose torch.nn.functional form takes ``inplace=``
FUNCTIONAL_FLAG = ("relu", "relu6", "hardtanh", "leaky_relu", "elu", "celu", "selu", "silu",
                   "mish", "hardswish", "hardsigmoid", "dropout")
_AUGMENTED = re.compile(r"^(\s*)([A-Za-z_][\w.]*)\s*=\s*\2\s*([-+*/])\s*(.+?)\s*$")
_METHOD = re.compile(r"\.(relu|sigmoid|tanh|neg|exp)\(\)")


def edit_line(line: str, op: str) -> str | None:
    """The line with ``op`` written in place, or None when its form is not one this knows."""
    name = op.split("::")[-1]
    if name in ("add", "sub", "mul", "div"):
        match = _AUGMENTED.match(line.rstrip("\n"))
        symbol = {"add": "+", "sub": "-", "mul": "*", "div": "/"}[name]
        if match and match.group(3) == symbol:
            indent, target, _, rest = match.groups()
            return f"{indent}{target} {symbol}= {rest}\n"
        if name == "mul" and re.search(r"F\.dropout\(", line):
            return _with_flag(line, "dropout")
        return None
    if name in FUNCTIONAL_FLAG and re.search(rf"F\.{name}\(", line):
        return _with_flag(line, name)
    if _METHOD.search(line) and f".{name}()" in line:
        return line.replace(f".{name}()", f".{name}_()", 1)
    return None


def _with_flag(line: str, name: str) -> str | None:
    start = line.index(f"F.{name}(") + len(f"F.{name}(")
    depth = 1
    for index in range(start, len(line)):
        depth += {"(": 1, ")": -1}.get(line[index], 0)
        if depth == 0:
            if "inplace" in line[start:index]:
                return None
            return line[:index] + ", inplace=True" + line[index:]
    return None


def profile(script: str, trace: str, steps: int) -> None:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    run = subprocess.run([sys.executable, "-c", "from memadvisor.cli import console_main; "
                          "console_main()", "profile", script, "-o", trace, "--steps",
                          str(steps), "--no-probes"], capture_output=True, text=True, env=env)
    if run.returncode:
        raise SystemExit(f"profiling {script} failed (exit {run.returncode}): "
                         f"{run.stderr.strip().splitlines()[-1:]}")


def check_refused(script: str, folder: str, advice: list, script_args: list[str]) -> list:
    """Each refused change this can edit, applied alone to a copy run with plain Python:
    does the run fail (an autograd refusal says 'inplace operation')?  A change refused
    because the script's own tensor would change (the batch, one held) may run: its harm
    is to the values, not an error."""
    with open(script, encoding="utf-8") as f:
        lines = f.readlines()
    outcomes = []
    for item in advice:
        path, _, number = item.location.rpartition(":")
        if not number or os.path.realpath(path) != os.path.realpath(script):
            continue
        new = edit_line(lines[int(number) - 1], item.details["op"])
        if new is None:
            outcomes.append({"location": item.location, "edit": None, "outcome": "no edit known"})
            continue
        edited = lines[:int(number) - 1] + [new] + lines[int(number):]
        copy = os.path.join(folder, "refused_" + os.path.basename(script))
        with open(copy, "w", encoding="utf-8") as f:
            f.writelines(edited)
        run = subprocess.run([sys.executable, copy, *script_args], capture_output=True,
                             text=True, timeout=600)
        error = (run.stderr.strip().splitlines() or [""])[-1]
        outcomes.append({"location": item.location, "edit": new.strip(), "reason": item.reason,
                         "exit": run.returncode, "error": error[:200],
                         "autograd_refused": "inplace operation" in run.stderr})
    return outcomes


def measured_peak(trace_path: str) -> int:
    from memadvisor.trace.io import read_trace
    from memadvisor.trace.summary import summarize
    return int(summarize(read_trace(trace_path))["peak_bytes"])


def inplace_advice(trace_path: str) -> list:
    from memadvisor.advice import collect
    from memadvisor.advice.inplace import inplace_advice as provider
    from memadvisor.simulate import hardware, prepare
    from memadvisor.trace.io import read_trace
    trace = read_trace(trace_path)
    return collect(trace, prepare(trace), hardware(None, "cpu"), providers=[provider])


def measure(script: str, steps: int = 3, folder: str | None = None,
            refused: bool = False, script_args: list[str] | None = None) -> dict:
    """Profile ``script`` and an edited copy; the predicted and measured peak drops
    (``refused``: also run each refused change alone, ``check_refused``)."""
    from memadvisor.advice import REFUSED, SUGGESTED
    folder = folder or tempfile.mkdtemp(prefix="inplace_advice_")
    original = os.path.join(folder, "original.trace")
    profile(script, original, steps)
    everything = inplace_advice(original)
    advice = [a for a in everything if a.status == SUGGESTED]
    refusals = check_refused(script, folder, [a for a in everything if a.status == REFUSED],
                             script_args or []) if refused else []
    edits = {}  # line number -> (op, new text)
    unedited = []
    with open(script, encoding="utf-8") as f:
        lines = f.readlines()
    for item in advice:
        if not item.location:
            continue  # the summary of them all
        path, _, number = item.location.rpartition(":")
        if os.path.realpath(path) != os.path.realpath(script):
            unedited.append(f"{item.location}: not in the script")
            continue
        line = int(number)
        new = edit_line(lines[line - 1], item.details["op"])
        if new is None:
            unedited.append(f"{item.location}: no edit known for {lines[line - 1].strip()!r}")
        else:
            edits[line] = (item.details["op"], new)
    for line, (_, new) in edits.items():
        lines[line - 1] = new
    copy = os.path.join(folder, os.path.basename(script))
    with open(copy, "w", encoding="utf-8") as f:
        f.writelines(lines)
    for name in os.listdir(os.path.dirname(os.path.abspath(script))):
        if name.endswith(".py") and name != os.path.basename(script):  # its own imports
            shutil.copy(os.path.join(os.path.dirname(os.path.abspath(script)), name), folder)
    edited = os.path.join(folder, "edited.trace")
    profile(copy, edited, steps)
    together = [a for a in advice if not a.location]
    predicted = together[0].bytes_saved if together else max(
        (a.bytes_saved for a in advice), default=0)
    before, after = measured_peak(original), measured_peak(edited)
    return {"script": script, "edits": {str(k): v[1].strip() for k, v in edits.items()},
            "unedited": unedited, "predicted_drop_bytes": int(predicted),
            "measured_drop_bytes": before - after, "peak_before_bytes": before,
            "peak_after_bytes": after,
            "advice": [{"title": a.title, "location": a.location, "bytes_saved": a.bytes_saved}
                       for a in advice],
            "refused_checked": refusals}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("script")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--keep", metavar="DIR", help="Keep the traces and the copy here.")
    parser.add_argument("--refused", action="store_true",
                        help="Also run each refused change alone (plain Python, the script's "
                             "own arguments after --): does autograd refuse it?")
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    args.script_args = script_args
    if not os.path.isfile(args.script):
        print(f"inplace_advice: {args.script}: no such script", file=sys.stderr)
        return 2
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
    result = measure(args.script, args.steps, args.keep, args.refused, args.script_args)
    print(json.dumps(result, indent=2))
    return 1 if result["unedited"] else 0


if __name__ == "__main__":
    sys.exit(main())
