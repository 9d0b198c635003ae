"""The docs site builds strictly (a warning fails it) and holds every page and public name.

Builds with `python -m mkdocs build --strict -f docs/mkdocs.yml` into a temporary
directory, as `nox -s docs` does; mkdocstrings reads the sources statically, so neither
Ray nor torch is imported here.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

pytest.importorskip("mkdocs", reason="the docs extra is not installed: pip install 'rdt_async[docs]'")
pytest.importorskip("material", reason="the docs extra is not installed: pip install 'rdt_async[docs]'")
pytest.importorskip("mkdocstrings_handlers.python", reason="the docs extra is not installed: pip install 'rdt_async[docs]'")

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
# The pages the site must have (docs/src/<name>.md -> <name>.html: browsable from disk).
PAGES = (
    "index", "concepts", "async", "transports", "collectives", "custom-transport",
    "migrating", "troubleshooting", "benchmarks", "api",
)
BENCH_FILES = tuple(f"{m}-{p}.png" for m in ("e2e_throughput", "e2e_latency", "loop_stall") for p in ("kept", "fresh", "fanout"))


def public_names() -> list[str]:
    """`rdt_async.__all__`, read from the source as the docs read it (no import)."""
    tree = ast.parse((ROOT / "rdt_async" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError("rdt_async/__init__.py has no literal __all__")


def build(config: Path, site: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=120,
    )


def check_built(proc: subprocess.CompletedProcess[str]) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"mkdocs build --strict failed (rc {proc.returncode}):\n{out[-6000:]}"
    warnings = [line for line in out.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert not warnings, "\n".join(warnings)


def text(html: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html))


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site as the repository builds it, from another working directory (paths are
    relative to the config file, not to where mkdocs runs)."""
    out = tmp_path_factory.mktemp("site")
    check_built(build(DOCS / "mkdocs.yml", out, cwd=tmp_path_factory.mktemp("cwd")))
    return out


def page(site: Path, name: str) -> str:
    path = site / f"{name}.html"
    assert path.is_file(), f"the site has no page {name!r} ({path.relative_to(site)} missing)"
    return path.read_text()


def test_the_site_builds_strictly_outside_the_repository(site: Path) -> None:
    assert (site / "index.html").is_file() and (site / "sitemap.xml").is_file()
    stray = [str(p.relative_to(ROOT)) for p in DOCS.rglob("*.html")]
    assert not stray, f"build output in the repository: {stray}"


_LINK = re.compile(r'(?:href|src)="([^"]+)"')


def test_the_site_opens_from_disk_every_link_a_file(site: Path) -> None:
    """Opened as files (no server), every link and image of every page lands on a file of
    the site, never a directory (a browser shows a directory as a listing)."""
    broken = []
    for html in site.rglob("*.html"):
        if html.parent.name == "search" or "404" in html.name:
            continue
        for link in _LINK.findall(html.read_text()):
            if re.match(r"[a-z][a-z0-9+.-]*:", link) or link.startswith(("#", "//")):
                continue  # another site, mailto:, data:, or an anchor of this page
            target = (html.parent / link.split("#")[0].split("?")[0]).resolve()
            if not target.is_file():
                broken.append(f"{html.relative_to(site)}: {link} ({'a directory' if target.is_dir() else 'missing'})")
    assert not broken, "\n".join(broken[:40])
    assert 'href="concepts.html"' in page(site, "index")


def test_every_page_is_built(site: Path) -> None:
    sources = {p.stem for p in (DOCS / "src").glob("*.md")}
    assert set(PAGES) <= sources, f"pages missing from docs/src: {sorted(set(PAGES) - sources)}"
    for name in sorted(sources):
        assert "<h1" in page(site, name), f"page {name!r} has no title"


def test_the_api_reference_documents_every_public_name(site: Path) -> None:
    api = page(site, "api")
    missing = [n for n in public_names() if f'id="rdt_async.{n}"' not in api]
    assert not missing, f"the API reference has no entry for rdt_async.{', rdt_async.'.join(missing)}"
    # Entries carry their docstrings, not only a heading: a few first lines, verbatim.
    for first_line in ("Return the value of an RDT object with real tensors.",
                       "Wait until writing", "Base class of every error rdt_async raises."):
        assert first_line in text(api), f"docstring text missing from the API page: {first_line!r}"


def test_examples_are_included_from_the_repository(site: Path) -> None:
    assert "include_dashboard" in text(page(site, "index")), "examples/quickstart.py is not included"
    assert text(page(site, "custom-transport")).count("class SpoolTransport") >= 2


def test_benchmarks_page_says_how_to_make_what_is_missing_or_embeds_it(site: Path) -> None:
    bench = page(site, "benchmarks")
    assert "python -m rdt_async.bench --quick --out docs/src/benchmarks" in text(bench)
    for name in (*BENCH_FILES, "results.md"):
        made = (DOCS / "src" / "benchmarks" / name).is_file()
        if name.endswith(".png"):
            assert (f'src="benchmarks/{name}"' in bench) == made, f"benchmarks/{name}: embedded {not made}, on disk {made}"
        if not made:
            assert f"Not generated in this build: benchmarks/{name}" in bench


def _png() -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")

    header = (1).to_bytes(4, "big") * 2 + bytes([8, 6, 0, 0, 0])
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 5)) + chunk(b"IEND", b"")


def _docs_copy(tmp_path: Path) -> Path:
    """docs/ copied without the bench's files, for a build of the benchmarks page: without
    the API reference's renderer and the search index (the site fixture builds those
    strictly; here they are ~60% of a build), and so without checking links into api.md."""
    copy = tmp_path / "repo"
    shutil.copytree(DOCS, copy / "docs", ignore=shutil.ignore_patterns("benchmarks"))
    for name in ("rdt_async", "examples"):
        (copy / name).symlink_to(ROOT / name)
    config = copy / "docs" / "mkdocs.yml"
    lines = config.read_text().splitlines(keepends=True)
    start = lines.index("plugins:\n")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].strip() and not lines[i].startswith(" ")), len(lines))
    config.write_text("".join(lines[:start] + lines[end:]).replace("  anchors: warn", "  anchors: info")
                      + "plugins: []\n")
    return copy


def test_benchmarks_page_without_the_generated_files_says_how_to_make_each(tmp_path: Path) -> None:
    """A build without the bench's files (some plots sit inside tabs) gives a note for each."""
    copy = _docs_copy(tmp_path)
    out = tmp_path / "site"
    check_built(build(copy / "docs" / "mkdocs.yml", out, cwd=tmp_path))
    bench = text(page(out, "benchmarks"))
    for name in (*BENCH_FILES, "results.md"):
        assert f"Not generated in this build: benchmarks/{name}" in bench, name


def test_benchmarks_page_embeds_generated_results(tmp_path: Path) -> None:
    """With the bench's files in place (stand-ins, in a copy of docs/), the page shows them."""
    copy = _docs_copy(tmp_path)
    generated = copy / "docs" / "src" / "benchmarks"
    generated.mkdir()
    for name in BENCH_FILES:
        (generated / name).write_bytes(_png())
    (generated / "results.md").write_text(  # shaped as rdt_async/bench/_report.py writes it
        "# rdt_async bench, stand-in\n\n## End to end\n\n| path | 4 KiB |\n| --- | --- |\n| stand-in row | 1 ms |\n"
    )
    (generated / "results.json").write_text("[]\n")
    out = tmp_path / "site"
    check_built(build(copy / "docs" / "mkdocs.yml", out, cwd=tmp_path))
    bench = page(out, "benchmarks")
    assert "stand-in row" in bench and "Not generated" not in bench
    assert bench.count("<h1") == 1 and '<h3 id="rdt_async-bench-stand-in"' in bench, "results.md's headings not demoted"
    for name in BENCH_FILES:
        assert f'src="benchmarks/{name}"' in bench and (out / "benchmarks" / name).is_file()
    assert not (out / "benchmarks" / "results.html").exists(), "results.md became a page of its own"
