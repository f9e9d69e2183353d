"""Byte sizes as users write them ('2GiB', '512MB', '1.5G', '1000000')."""

from __future__ import annotations

import os
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


def env_bytes(name: str) -> int | None:
    """The byte size in environment variable ``name``, or None where it is unset or blank;
    ValueError naming the variable for anything else."""
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        return parse_bytes(value)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
