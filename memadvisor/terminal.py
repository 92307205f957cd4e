"""Text for a terminal from strings a trace or script chose (module names, paths, error
messages): control characters are shown, never obeyed.  An ANSI/OSC escape in a module
name could otherwise clear the screen or set the window title when ``summary`` prints it."""
from __future__ import annotations

import re

#: C0 controls but tab and newline, DEL, and C1 controls (ESC [ ... is ESC then text)
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def safe_text(text: str) -> str:
    """``text`` with every control character but newline and tab shown as ``\\xNN``."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", str(text))
