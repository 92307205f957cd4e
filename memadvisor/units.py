"""Byte sizes for people: parsing '24GiB' / '1.5 GB' and printing 1.2 GiB."""
from __future__ import annotations

import math
import re
from decimal import Decimal
from fractions import Fraction

from .errors import UserError

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
#: no unit starts with 'e', so '1e3GB' reads one way: 1e3 GB
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*")
MAX_BYTES = 2**63 - 1  #: byte counts are int64 in a trace


def parse_bytes(text: str) -> int:
    """'24GiB' -> 25769803776; '16GB' -> 16e9; '1e3' -> 1000; '512' -> 512, rounded down to
    whole bytes.  Bad text, or a size under one byte -> UserError."""
    match = _SIZE.fullmatch(str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise UserError(f"not a size: {text!r} (write e.g. 24GiB, 16GB, 512MiB)")
    number = Decimal(match.group(1))
    if number == 0:
        raise UserError(f"size must be positive: {text!r}")
    # bound the exponent before exact arithmetic: 1e-999999999 must not build 10**999999999
    if number.adjusted() > 30:
        raise UserError(f"size too large: {text!r}")
    value = 0 if number.adjusted() < -30 else math.floor(Fraction(number) * _UNITS[unit])
    if value < 1:
        raise UserError(f"size must be at least 1 byte: {text!r} rounds down to 0 bytes")
    if value > MAX_BYTES:
        raise UserError(f"size too large: {text!r}")
    return value


def format_bytes(value: float) -> str:
    """Binary units, three significant digits: 1.23 GiB, 512 B, -4.00 MiB."""
    sign = "-" if value < 0 else ""
    value = abs(float(value))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            if unit == "B":
                return f"{sign}{int(value)} B"
            return f"{sign}{value:.3g} {unit}" if value < 100 else f"{sign}{value:.0f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
