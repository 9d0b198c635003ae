"""Hide the packages named in RDT_HIDE_PACKAGES (comma-separated) from this interpreter.

Put this directory on PYTHONPATH with RDT_HIDE_PACKAGES=nixl,ucxx and the process, and
every Ray worker it starts (they inherit its environment), behaves as if those packages
were not installed: `import nixl` raises ModuleNotFoundError and
`importlib.util.find_spec("nixl")` returns None, as in an environment without them. No
second virtual environment is needed. Python imports `sitecustomize` at startup, after
the site-packages' .pth files, so every finder already on `sys.meta_path` is wrapped.
"""

from __future__ import annotations

import os
import sys
from typing import Any

HIDDEN = frozenset(p.strip() for p in os.environ.get("RDT_HIDE_PACKAGES", "").split(",") if p.strip())


class _Hiding:
    """A meta path finder that finds nothing under a hidden name, and defers to `finder` otherwise."""

    def __init__(self, finder: Any) -> None:
        self._finder = finder

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name.partition(".")[0] in HIDDEN:
            return None
        find = getattr(self._finder, "find_spec", None)
        return None if find is None else find(name, path, target)

    def __getattr__(self, attr: str) -> Any:  # invalidate_caches, find_distributions, ...
        return getattr(self._finder, attr)


if HIDDEN:
    for _name in [m for m in sys.modules if m.partition(".")[0] in HIDDEN]:
        del sys.modules[_name]
    sys.meta_path[:] = [f if isinstance(f, _Hiding) else _Hiding(f) for f in sys.meta_path]
