"""Byte sizes as users write them ('2GiB', '512MB', '1.5G', '1000000')."""

from __future__ import annotations

import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_bytes(text: str) -> int:
    """'2147483648', '2GiB', '512MB', '1.5G' -> bytes; ValueError for anything else."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"not a byte size: {text!r} (e.g. 2GiB, 512MB, 1000000)")
    number, unit = match.groups()
    unit = (unit or "").lower().removesuffix("b")
    return int(float(number) * _UNITS[unit])
