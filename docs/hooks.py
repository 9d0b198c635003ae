"""MkDocs hooks: the benchmarks page before its generated files exist.

`python -m rdt_async.bench --quick --out docs/src/benchmarks` writes the table and the
plots that docs/src/benchmarks.md embeds. They are not kept in the repository, so a
fresh checkout has none: each missing one is replaced by a note that says how to make
it, and the strict build passes either way.
"""

from __future__ import annotations

import os
import re

PAGE = "benchmarks.md"
REGENERATE = "python -m rdt_async.bench --quick --out docs/src/benchmarks"
_IMAGE = re.compile(r"^!\[(?P<alt>[^\]]*)\]\((?P<path>benchmarks/[^)\s]+)\)\s*$", re.M)
_SNIPPET = re.compile(r'^--8<-- "(?P<path>benchmarks/[^"]+)"\s*$', re.M)


def _missing(path: str, what: str) -> str:
    return (
        f'!!! note "Not generated in this build: {path}"\n'
        f"    The {what} comes from the benchmark run; make it with `{REGENERATE}`, then build again.\n"
    )


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ANN001 (MkDocs objects)
    if page.file.src_uri != PAGE:
        return markdown
    docs_dir = config["docs_dir"]

    def image(m: re.Match[str]) -> str:
        found = os.path.exists(os.path.join(docs_dir, m["path"]))
        return m[0] if found else _missing(m["path"], f"plot ({m['alt']})")

    def snippet(m: re.Match[str]) -> str:
        found = os.path.exists(os.path.join(docs_dir, m["path"]))
        return m[0] if found else _missing(m["path"], "table")

    return _SNIPPET.sub(snippet, _IMAGE.sub(image, markdown))
