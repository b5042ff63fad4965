"""Byte sizes written with a unit: "512MiB", "16GB", "192GiB" or a plain number of bytes."""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """The number of bytes `text` names; ValueError when it names none."""
    match = re.fullmatch(r"\s*([\d.]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read a size from {text!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
