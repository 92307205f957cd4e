"""What the browser tests share: the system Chromium, its flags, where screenshots go, and
the marks that skip a test where Chromium or Playwright is missing."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

CHROMIUM = os.environ.get("MEMADVISOR_CHROMIUM", "/usr/bin/chromium")
SCREENSHOTS = Path(__file__).resolve().parents[2] / "reports"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]

MARKS = [
    pytest.mark.browser,
    pytest.mark.skipif(not Path(CHROMIUM).exists() and shutil.which("chromium") is None,
                       reason="no system Chromium"),
]
