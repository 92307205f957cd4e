"""One cache of runs for the apply tests: the unmodified examples and single-process plans
are each run once per test session, whichever test asks first."""
import pytest

from apply_runs import EXAMPLES, run_applied, run_original


class Runs:
    def __init__(self, folder):
        self.folder = folder
        self._cache = {}

    def original(self, name, args):
        key = (name, "<original>", tuple(args))
        if key not in self._cache:
            self._cache[key] = run_original(EXAMPLES / name, args)
        return self._cache[key]

    def applied(self, name, plan, args):
        key = (name, plan, tuple(args))
        if key not in self._cache:
            self._cache[key] = run_applied(EXAMPLES / name, plan, args, self.folder)
        return self._cache[key]


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory.mktemp("apply_runs"))
