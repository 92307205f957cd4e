"""Strings a trace chose are shown, never obeyed, on the terminal."""
from __future__ import annotations

import subprocess
import sys

import pandas as pd

from memadvisor.terminal import safe_text
from memadvisor.trace import read_trace, write_trace
from memadvisor.report.synthetic import make_trace

HOSTILE = "blocks.0\x1b]0;pwned\x07\x1b[2J\x9b31m"


def test_control_characters_are_shown_as_escapes():
    assert safe_text("a\tb\nc") == "a\tb\nc"
    assert safe_text(HOSTILE) == "blocks.0\\x1b]0;pwned\\x07\\x1b[2J\\x9b31m"


def test_summary_never_prints_an_escape_from_the_trace(tmp_path):
    trace = read_trace(make_trace(tmp_path / "t.trace", 600))
    events = trace.events.copy()
    events["module"] = events["module"].astype(str).where(events["category"] != "activation",
                                                        HOSTILE)
    events["source_file"] = events["source_file"].astype(str) + "\x1b[2J"
    hostile = tmp_path / "hostile.trace"
    write_trace(hostile, events, trace.meta)
    out = subprocess.run([sys.executable, "-m", "memadvisor.cli", "summary", str(hostile)],
                         capture_output=True, text=True, check=True).stdout
    assert "\x1b" not in out and "\x07" not in out and "\x9b" not in out
    assert "\\x1b[2J" in out  # shown, so the user sees something odd is there


def test_dashboard_refuses_to_listen_beyond_loopback_without_expose(tmp_path):
    trace = make_trace(tmp_path / "t.trace", 300)
    for host in ("0.0.0.0", "", "::"):
        done = subprocess.run([sys.executable, "-m", "memadvisor.cli", "ui", str(trace),
                               "--host", host, "--no-browser"], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 2 and "--expose" in done.stderr, (host, done.stderr)
        assert done.stderr.count("\n") == 1
