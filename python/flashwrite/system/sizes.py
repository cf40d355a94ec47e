"""Byte sizes for people: ``parse_size`` reads "64MiB", ``fmt_bytes`` writes it."""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SHOWN = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def parse_size(text: str | int) -> int:
    """'64MiB' -> 67108864, '1.5GiB', '2G' (decimal), '4096' (bytes)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (try 64MiB, 1GiB, 2G)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def fmt_bytes(n: int | float | None) -> str:
    """``n`` bytes in the largest binary unit it fills: "2 GiB", "1.50 MiB", "512 B";
    "-" for None (a size nobody knows)."""
    if n is None:
        return "-"
    for unit, scale in _SHOWN:
        if n >= scale:
            v = n / scale
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.2f} {unit}"
    return f"{int(n)} B"
