import json
import pkgutil
import subprocess
import sys

import memadvisor.advice


def test_advice_imports_neither_torch_nor_dash():
    names = ["memadvisor.advice"] + [
        f"memadvisor.advice.{m.name}" for m in pkgutil.iter_modules(memadvisor.advice.__path__)]
    code = ("import importlib, json, sys\n"
            f"for name in {names!r}: importlib.import_module(name)\n"
            "import memadvisor.advice as a\n"
            "print(json.dumps(sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('torch', 'dash'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []
    assert len(names) >= 5
