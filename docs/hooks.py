"""MkDocs hooks: the benchmarks page and the files the benchmark run generates.

`python -m rdt_async.bench --quick --out docs/src/benchmarks` writes the table
(results.md) and the plots that docs/src/benchmarks.md embeds (also inside its tabs). The
repository keeps the latest run's; where one is missing (a renamed plot, a deleted file)
it is replaced by a note that says how to make it, and the strict build passes either way. A results.md that is there
is included with its headings moved under the page's own section ("# " becomes "### ").
"""

from __future__ import annotations

import os
import re

PAGE = "benchmarks.md"
REGENERATE = "python -m rdt_async.bench --quick --out docs/src/benchmarks"
DEMOTE = 2  # heading levels added to an included results.md
_IMAGE = re.compile(r"^(?P<indent>[ \t]*)!\[(?P<alt>[^\]]*)\]\((?P<path>benchmarks/[^)\s]+)\)[ \t]*$", re.M)
_SNIPPET = re.compile(r'^--8<-- "(?P<path>benchmarks/[^"]+\.md)"\s*$', re.M)
_FENCE = re.compile(r"^\s*(```|~~~)")


def _missing(path: str, what: str, indent: str = "") -> str:
    """A note in place of a missing file, indented as the line it replaces (in a tab, say)."""
    return (
        f'{indent}!!! note "Not generated in this build: {path}"\n'
        f"{indent}    The {what} comes from the benchmark run; make it with `{REGENERATE}`, then build again.\n"
    )


def _demoted(markdown: str) -> str:
    """`markdown` with every ATX heading outside code fences `DEMOTE` levels deeper."""
    out, fenced = [], False
    for line in markdown.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            line = "#" * DEMOTE + line
        out.append(line)
    return "\n".join(out) + "\n"


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    docs_dir = config["docs_dir"]

    def image(m: re.Match[str]) -> str:
        found = os.path.isfile(os.path.join(docs_dir, m["path"]))
        return m[0] if found else _missing(m["path"], f"plot ({m['alt']})", m["indent"])

    def snippet(m: re.Match[str]) -> str:
        path = os.path.join(docs_dir, m["path"])
        if not os.path.isfile(path):
            return _missing(m["path"], "table")
        with open(path, encoding="utf-8") as f:
            return _demoted(f.read())

    return _SNIPPET.sub(snippet, _IMAGE.sub(image, markdown))
