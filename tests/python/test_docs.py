"""Documentation the code points at exists: every docs/design.md section a comment or
docstring cites by title, and every relative link in the README and docs/."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"
SOURCE_DIRS = ("muon_ext", "csrc", "tests", "bench", "examples", "docs")
SOURCE_SUFFIXES = {".py", ".h", ".cpp", ".cu", ".cuh", ".md", ".sh", ".txt"}

# A citation: design.md, then within a few characters a quoted section title, e.g.
# (docs/design.md, "Muon in three phases"). Comment markers at line starts are dropped
# first, so a title wrapped over two comment lines still reads as one.
CITATION = re.compile(r'design\.md\W{0,4}(?:sections?\s+)?"([^"]{3,80})"')
COMMENT_BREAK = re.compile(r"\s*\n\s*(?:#|//|\*|///)?\s*")


def _source_files():
    for top in SOURCE_DIRS:
        for path in (ROOT / top).rglob("*"):
            if path.suffix in SOURCE_SUFFIXES and path.is_file() and "__pycache__" not in path.parts:
                yield path


def _design_titles():
    return [line.lstrip("#").strip() for line in DESIGN.read_text().splitlines() if line.startswith("#")]


def _citations():
    found = []
    for path in _source_files():
        if path == Path(__file__):
            continue
        text = COMMENT_BREAK.sub(" ", path.read_text(errors="replace"))
        found += [(path.relative_to(ROOT), title) for title in CITATION.findall(text)]
    return found


def test_cited_design_sections_exist():
    titles = _design_titles()
    citations = _citations()
    assert len(citations) > 20, "the citation pattern no longer finds the code's citations"
    # A citation may shorten a title to its leading words ("Param writers" for
    # "Param writers, quantized params, adapters").
    missing = [(str(path), title) for path, title in citations
               if not any(t == title or t.startswith(title + ",") or t.startswith(title + " (") for t in titles)]
    assert not missing, f"cited design.md sections that do not exist: {missing}"


def test_citation_check_can_fail(tmp_path):
    text = COMMENT_BREAK.sub(" ", '# see docs/design.md, "No such\n# section"\n')
    assert CITATION.findall(text) == ["No such section"]
    assert "No such section" not in _design_titles()


MARKDOWN_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("doc", ["README.md", "docs/guide.md", "docs/design.md", "docs/train_gpt.md", "bench/RESULTS.md"])
def test_relative_links_resolve(doc):
    path = ROOT / doc
    links = [link for link in MARKDOWN_LINK.findall(path.read_text()) if "://" not in link]
    broken = [link for link in links if not (path.parent / link).exists()]
    assert not broken, f"{doc} links to missing files: {broken}"
