"""The diagrams and the Markdown pages stay in step with each other and with the files they name.

- every `diagrams/*.mmd` source has its rendered SVG beside it, and that SVG is a real SVG;
- every ```mermaid block in `docs/architecture.md` is exactly one of the `diagrams/*.mmd`
  sources, so the page GitHub draws and the SVGs cannot drift apart;
- every relative link or image in the top-level pages, `docs/`, `diagrams/` and `weeks/` that
  names a .md, .svg or .png file points to a file that exists.

Plain text parsing only: no network, no browser, no Mermaid.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
DIAGRAMS = ROOT / "diagrams"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
SVG_NAMESPACE = "{http://www.w3.org/2000/svg}"
CHECKED_SUFFIXES = (".md", ".svg", ".png")


def mermaid_sources() -> list[Path]:
    return sorted(DIAGRAMS.glob("*.mmd"))


def pages_with_links() -> list[Path]:
    """The Markdown pages whose links are checked; those not written yet are simply absent."""
    pages = [ROOT / "README.md", ROOT / "PLAN.md"]
    pages += sorted((ROOT / "docs").glob("*.md"))
    pages += sorted(DIAGRAMS.glob("*.md"))
    pages += sorted((ROOT / "weeks").glob("**/*.md"))
    return [p for p in pages if p.is_file()]


def _id(path: Path) -> str:
    return str(path.relative_to(ROOT))


# ------------------------------------------------------------------------------ diagrams


def test_there_are_diagrams():
    assert mermaid_sources(), f"no Mermaid sources (*.mmd) found in {_id(DIAGRAMS)}/"


@pytest.mark.parametrize("source", mermaid_sources(), ids=_id)
def test_each_source_has_a_valid_svg(source: Path):
    svg = source.with_suffix(".svg")
    how = "render it as diagrams/README.md says"
    assert svg.is_file(), f"{_id(source)} has no rendered {svg.name} beside it: {how}"
    assert svg.stat().st_size > 0, f"{_id(svg)} is empty: {how}"
    try:
        root = ET.parse(svg).getroot()
    except ET.ParseError as e:
        pytest.fail(f"{_id(svg)} is not well-formed XML ({e}): {how}")
    assert root.tag in ("svg", SVG_NAMESPACE + "svg"), f"{_id(svg)}: the root element is <{root.tag}>, not <svg>"


# ------------------------------------------------------------------- docs/architecture.md

MERMAID_BLOCK = re.compile(r"^```mermaid[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def test_architecture_mermaid_blocks_match_the_sources():
    assert ARCHITECTURE.is_file(), f"{_id(ARCHITECTURE)} is missing"
    blocks = MERMAID_BLOCK.findall(ARCHITECTURE.read_text(encoding="utf-8"))
    assert blocks, f"{_id(ARCHITECTURE)} has no ```mermaid blocks"
    sources = {p.read_text(encoding="utf-8").strip(): p.name for p in mermaid_sources()}
    for i, block in enumerate(blocks, start=1):
        first_line = block.strip().splitlines()[0] if block.strip() else "(empty)"
        assert block.strip() in sources, (
            f"mermaid block {i} of {_id(ARCHITECTURE)} (starting {first_line!r}) is not the content "
            f"of any diagrams/*.mmd file: copy the source into the block (or the block into the "
            f"source, and re-render its SVG)"
        )


# ------------------------------------------------------------------------------ links

FENCED_CODE = re.compile(r"^[ \t]*(```|~~~).*?^[ \t]*\1[ \t]*$", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"(`+).+?\1", re.DOTALL)
# [text](target "title") and ![alt](target); the target may be wrapped in <...>.
INLINE_LINK = re.compile(r"\]\(\s*(<[^>]*>|[^)\s]+)")
# [label]: target   (reference-style definitions)
REFERENCE_DEF = re.compile(r"^[ \t]{0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)", re.MULTILINE)
# <img src="..."> and <a href="...">
HTML_ATTR = re.compile(r"""\b(?:src|href)\s*=\s*["']([^"']+)["']""", re.IGNORECASE)
HAS_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def link_targets(markdown: str) -> list[str]:
    """Every link and image target of a Markdown page, code blocks and inline code left out."""
    text = INLINE_CODE.sub("", FENCED_CODE.sub("", markdown))
    found = INLINE_LINK.findall(text) + REFERENCE_DEF.findall(text) + HTML_ATTR.findall(text)
    return [t.strip("<>").strip() for t in found]


def local_file_target(target: str) -> str | None:
    """The relative path a link names, if it is one we check; None for URLs, anchors and the rest."""
    if not target or target.startswith(("#", "/")) or HAS_SCHEME.match(target):
        return None
    path = unquote(target.split("#", 1)[0].split("?", 1)[0])
    return path if path.lower().endswith(CHECKED_SUFFIXES) else None


def test_link_extraction():
    page = (
        "See [the map](docs/architecture.md#layers), ![block](../diagrams/x.svg \"title\"),\n"
        "[site](https://example.com/a.md), [anchor](#top), <img src=\"img/a%20b.png\">,\n"
        "`[not a link](inline.md)` and [code](<spaced name.md>).\n\n"
        "```\n[also not](fenced.md)\n```\n\n"
        "[ref]: weeks/week01/README.md\n"
    )
    paths = [p for p in map(local_file_target, link_targets(page)) if p]
    assert sorted(paths) == sorted([
        "docs/architecture.md", "../diagrams/x.svg", "img/a b.png", "spaced name.md", "weeks/week01/README.md",
    ])


@pytest.mark.parametrize("page", pages_with_links(), ids=_id)
def test_relative_links_point_to_existing_files(page: Path):
    missing = []
    for target in link_targets(page.read_text(encoding="utf-8")):
        path = local_file_target(target)
        if path is not None and not (page.parent / path).exists():
            missing.append(target)
    assert not missing, f"{_id(page)} links to files that do not exist: {', '.join(missing)}"
