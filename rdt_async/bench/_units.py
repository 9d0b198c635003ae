"""Sizes as people write and read them: parse_size("64M"), human(1 << 20)."""

from __future__ import annotations


def parse_size(s: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    s = s.strip().upper().removesuffix("B")
    return int(float(s[:-1]) * units[s[-1]]) if s[-1] in units else int(s)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.4g} {unit}"
        n /= 1024
    return str(n)
