import json
import pkgutil
import subprocess
import sys

import memadvisor.simulate


def test_simulate_imports_neither_torch_nor_dash():
    names = ["memadvisor.simulate"] + [
        f"memadvisor.simulate.{m.name}" for m in pkgutil.iter_modules(memadvisor.simulate.__path__)]
    names += ["memadvisor.commands.simulate", "memadvisor.commands.advise"]
    code = ("import importlib, json, sys\n"
            f"for name in {names!r}: importlib.import_module(name)\n"
            "print(json.dumps(sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('torch', 'dash'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []
    assert len(names) >= 14  # every technique module was imported
