"""Sizes as people write them (4K, 64M, 1G) and as they read them; the JSON result."""

from __future__ import annotations

import json
import sys
from typing import IO, Any


def parse_size(s: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    s = s.strip().upper().removesuffix("B")
    return int(float(s[:-1]) * units[s[-1]]) if s[-1] in units else int(s)


def write_json(result: dict[str, Any], path: str) -> IO[str]:
    """Write `result` to `path` ('-': stdout); return where the table goes (the other stream)."""
    text = json.dumps(result, indent=2)
    if path == "-":
        print(text)
        return sys.stderr
    with open(path, "w") as f:
        f.write(text + "\n")
    return sys.stdout


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.4g} {unit}"
        n /= 1024
    return str(n)
