import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import memadvisor.advice

ROOT = Path(__file__).parents[2]


def test_advice_imports_and_runs_without_torch_or_dash(tmp_path):
    # the read-the-trace analyses (compile_saving runs torch.compile in a child: its own)
    names = ["memadvisor.advice"] + [
        f"memadvisor.advice.{m.name}" for m in pkgutil.iter_modules(memadvisor.advice.__path__)
        if m.name != "compile_saving"]
    code = ("import importlib, json, sys\n"
            f"for name in {names!r}: importlib.import_module(name)\n"
            "from tests.advice.test_inplace import EVENTS\n"
            "from tests.advice.traces import load, write_events\n"
            "from memadvisor.advice import collect, PROVIDERS\n"
            "from memadvisor.simulate import hardware\n"
            f"trace, base = load(write_events({str(tmp_path / 't.trace')!r}, EVENTS))\n"
            "found = [collect(trace, base, hardware(name), providers=[p])\n"
            "         for name in ('h100-80gb', None) for p in PROVIDERS\n"
            "         if p.__module__ != 'memadvisor.advice.compile_saving']\n"
            "assert any(found)\n"
            "print(json.dumps(sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('torch', 'dash'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
    assert len(names) >= 5
    from memadvisor.advice import PROVIDERS
    assert {p.__module__ for p in PROVIDERS} >= {"memadvisor.advice.inplace",
                                                 "memadvisor.advice.allocator_settings",
                                                 "memadvisor.advice.data_loading"}
