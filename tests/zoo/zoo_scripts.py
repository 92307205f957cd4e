"""The script zoo (``zoo/``): which scripts there are, the ground truth each declares in
its ``# zoo:`` header, and how to run one plainly.

The header is a block of comment lines starting with ``# zoo: {`` and holding one JSON
object (continued on the following ``#`` lines), e.g.::

    # zoo: {"batch_size": 8, "batch_layout": "batch-first", "steps_per_iteration": 1,
    #   "optimizers": 1, "framework": "raw", "iterations": 3, "exact_split": true,
    #   "plans": ["amp-bf16", "checkpoint", "accum", "ddp", "zero2", "zero3"]}

``batch_size``: rows of the batch one iteration feeds the model; ``batch_layout``: where
those rows are (batch-first, seq-first, packed, kwargs); ``steps_per_iteration``:
``optimizer.step`` calls per iteration; ``optimizers``: ``torch.optim`` optimizers (0:
manual updates); ``framework``: raw, hf-trainer, lightning or accelerate; ``iterations``:
what the script runs by default (what a user calls its steps); ``exact_split``: whether
splitting the batch (accumulation, data parallel) leaves the math unchanged, and if not,
``split_note`` says why; ``plans``: the plan kinds a tool ought to realise on it.
Imported by the zoo tests and by ``benchmarks/zoo_matrix.py``.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ZOO = REPO / "zoo"
REQUIRED_KEYS = {"batch_size": int, "batch_layout": str, "steps_per_iteration": int,
                 "optimizers": int, "framework": str, "iterations": int, "exact_split": bool,
                 "plans": list}
LAYOUTS = {"batch-first", "seq-first", "packed", "kwargs"}
#: framework -> the package it needs (the ``zoo`` extra)
FRAMEWORK_PACKAGES = {"raw": None, "hf-trainer": "transformers", "lightning": "lightning",
                      "accelerate": "accelerate"}
ITERATION_LINE = re.compile(r"^iter\s+\d+", re.MULTILINE)
FINAL_LOSS = re.compile(r"final_loss=([-+0-9.eE]+|nan|inf)")


@dataclass(frozen=True)
class ZooScript:
    path: Path
    truth: dict

    @property
    def name(self) -> str:
        return self.path.stem

    @property
    def package(self) -> str | None:
        return FRAMEWORK_PACKAGES[self.truth["framework"]]

    def missing_package(self) -> str | None:
        """The optional package this script needs and this machine lacks, else None."""
        if self.package and importlib.util.find_spec(self.package) is None:
            return self.package
        return None


def parse_header(text: str, source: str = "<script>") -> dict:
    """The JSON object of a script's ``# zoo:`` comment block; ValueError when missing or bad."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("# zoo: {")), None)
    if start is None:
        raise ValueError(f"{source}: no '# zoo: {{' header")
    body = lines[start][len("# zoo:"):]
    for line in lines[start + 1:]:
        if not line.startswith("#"):
            break
        body += "\n" + line[1:]
    truth = json.loads(body)
    for key, kind in REQUIRED_KEYS.items():
        if not isinstance(truth.get(key), kind):
            raise ValueError(f"{source}: header key {key!r} missing or not {kind.__name__}")
    if truth["batch_layout"] not in LAYOUTS:
        raise ValueError(f"{source}: batch_layout {truth['batch_layout']!r} not in {sorted(LAYOUTS)}")
    if truth["framework"] not in FRAMEWORK_PACKAGES:
        raise ValueError(f"{source}: unknown framework {truth['framework']!r}")
    if not truth["exact_split"] and not truth.get("split_note"):
        raise ValueError(f"{source}: exact_split false needs a split_note saying why")
    return truth


def zoo_scripts() -> list[ZooScript]:
    return [ZooScript(path, parse_header(path.read_text(), path.name))
            # not a verification's transient copy (".NAME_memadvisor_verify_*.py", made
            # beside the script while another benchmark runs one)
            for path in sorted(ZOO.glob("*.py")) if not path.name.startswith(("_", "."))]


def quiet_environment(threads: int = 1) -> dict:
    """The environment a zoo script runs in here: one thread each (two run side by side on
    a 2-core machine), no tokenizer thread pool, no HF telemetry or hub look-ups."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "PYTHONUNBUFFERED": "1"}


def run_plainly(script: ZooScript, timeout_s: float = 150) -> subprocess.CompletedProcess:
    """``python zoo/X.py`` with no arguments, from the repository root."""
    return subprocess.run([sys.executable, str(script.path)], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout_s, env=quiet_environment())


def iterations_printed(stdout: str) -> int:
    return len(ITERATION_LINE.findall(stdout))


def final_loss(stdout: str) -> float | None:
    found = FINAL_LOSS.findall(stdout)
    return float(found[-1]) if found else None


def load_benchmark(name: str):
    """``benchmarks/NAME.py`` as a module (the zoo tests judge as the benchmarks do)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module
