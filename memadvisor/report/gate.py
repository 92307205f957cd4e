"""``memadvisor check``'s core: judge a trace against a budget and a baseline.

Each check is a ``CheckResult`` with a one-line message; the command prints them and exits 1
when one fails.  The peak judged is the analysed (last complete) step's peak from
``summarize``, the number ``memadvisor summary`` shows.
"""
from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from typing import Any

from ..errors import UserError
from ..units import format_bytes, parse_bytes

_PERCENT = re.compile(r"^\s*\+?([0-9]*\.?[0-9]+)\s*%\s*$")
_ZERO = re.compile(r"^\s*\+?0*\.?0+\s*([a-zA-Z]*)\s*$")


@dataclass(frozen=True)
class Increase:
    """How much the peak may grow over the baseline: a ratio (``5%``) or bytes (``100MiB``)."""

    ratio: float | None = None
    size_bytes: int | None = None

    @classmethod
    def parse(cls, text: str) -> "Increase":
        match = _PERCENT.match(str(text))
        if match:
            return cls(ratio=float(match.group(1)) / 100)
        try:
            zero = _ZERO.match(str(text))
            if zero:  # parse_bytes refuses 0 (a budget of 0 is a mistake; no growth is not)
                parse_bytes("1" + zero.group(1))
                return cls(size_bytes=0)
            return cls(size_bytes=parse_bytes(str(text).strip().lstrip("+")))
        except UserError:
            raise UserError(f"--max-increase: not a percentage or size: {text!r} "
                            f"(write e.g. 5% or 100MiB)", exit_code=2) from None

    def allowed_bytes(self, baseline_bytes: int) -> int:
        if self.ratio is not None:
            return int(baseline_bytes * self.ratio)
        return int(self.size_bytes or 0)

    def __str__(self) -> str:
        if self.ratio is not None:
            return f"+{100 * self.ratio:g}%"
        return f"+{format_bytes(self.size_bytes or 0)}"


@dataclass
class CheckResult:
    name: str  #: 'budget' or 'regression'
    passed: bool
    message: str  #: one line, says the numbers
    measured_bytes: int
    limit_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "passed": self.passed, "message": self.message,
                "measured_bytes": self.measured_bytes, "limit_bytes": self.limit_bytes}


def _where(summary: dict[str, Any]) -> str:
    step = summary["analysed_step"]
    return f"step {step}" if step is not None else "whole run, no step completed"


def budget_check(summary: dict[str, Any], budget_bytes: int) -> CheckResult:
    peak = summary["peak_bytes"]
    fb = format_bytes
    if peak <= budget_bytes:
        message = (f"peak {fb(peak)} ({_where(summary)}) fits the {fb(budget_bytes)} budget, "
                   f"{fb(budget_bytes - peak)} to spare ({100 * peak / budget_bytes:.1f}% used)")
    else:
        message = (f"peak {fb(peak)} ({_where(summary)}) is over the {fb(budget_bytes)} "
                   f"budget by {fb(peak - budget_bytes)}")
    return CheckResult("budget", peak <= budget_bytes, message, peak, budget_bytes)


def regression_check(summary: dict[str, Any], baseline: dict[str, Any],
                     max_increase: Increase) -> CheckResult:
    peak, old = summary["peak_bytes"], baseline["peak_bytes"]
    allowed = max_increase.allowed_bytes(old)
    change = peak - old
    pct = f", {100 * change / old:+.1f}%" if old else ""
    sign = "+" if change >= 0 else ""
    what = (f"peak {format_bytes(peak)} vs baseline {format_bytes(old)} "
            f"({sign}{format_bytes(change)}{pct})")
    passed = change <= allowed
    verdict = "within" if passed else "more than"
    return CheckResult("regression", passed, f"{what}, {verdict} the allowed {max_increase}",
                       peak, old + allowed)


def require_complete_step(summary: dict[str, Any]) -> None:
    """A gate must not pass a run that never finished a step: its peak means nothing."""
    if summary["analysed_step"] is None:
        why = f": {summary['error']}" if summary.get("error") else ""
        raise UserError(f"{summary['trace']}: the profiled run completed no training step "
                        f"(status {summary['status']}{why}); nothing to check", exit_code=2)


def run_checks(summary: dict[str, Any], *, budget_bytes: int | None = None,
               baseline: dict[str, Any] | None = None,
               max_increase: Increase = Increase(ratio=0.05)) -> list[CheckResult]:
    """``summary`` and ``baseline`` are ``summarize()`` results with a complete step."""
    results = []
    if budget_bytes is not None:
        results.append(budget_check(summary, budget_bytes))
    if baseline is not None:
        results.append(regression_check(summary, baseline, max_increase))
    if summary.get("status", "completed") != "completed":
        for result in results:  # judged on the last complete step; say the run did not end well
            result.message += f" (the run ended with status {summary['status']})"
    return results


def junit_xml(results: list[CheckResult], *, trace_path: str = "", elapsed_s: float = 0.0,
              error: str | None = None) -> str:
    """A JUnit XML document: one testcase per check (or one erroring case for bad input)."""
    failures = sum(not r.passed for r in results)
    errors = 1 if error else 0
    tests = len(results) + errors
    suites = ET.Element("testsuites", name="memadvisor", tests=str(tests),
                        failures=str(failures), errors=str(errors))
    suite = ET.SubElement(suites, "testsuite", name="memadvisor.check", tests=str(tests),
                          failures=str(failures), errors=str(errors), time=f"{elapsed_s:.3f}")
    properties = ET.SubElement(suite, "properties")
    ET.SubElement(properties, "property", name="trace", value=str(trace_path))
    for result in results:
        case = ET.SubElement(suite, "testcase", classname="memadvisor.check", name=result.name,
                             time="0")
        if result.passed:
            ET.SubElement(case, "system-out").text = result.message
        else:
            ET.SubElement(case, "failure", message=result.message,
                          type=f"memadvisor.{result.name}").text = result.message
    if error:
        case = ET.SubElement(suite, "testcase", classname="memadvisor.check", name="input",
                             time="0")
        ET.SubElement(case, "error", message=error, type="memadvisor.input").text = error
    ET.indent(suites)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(suites, "unicode") + "\n"
