"""docs/STATUS.md is one page, true today (issue 60, item 5): under 300 lines, every path and test it names
exists, and every link to a section (its own, docs/benchmarks.md's, or one into it from the other docs)
lands on a heading. The diary it replaced named seven files that no longer existed."""
from __future__ import annotations

import re
from pathlib import Path

from test_readme import named_paths

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
STATUS = DOCS / "STATUS.md"


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a markdown file's headings: lower case, punctuation but `-` and `_` dropped,
    spaces as `-`, a repeated heading suffixed -1, -2, ...; headings inside code blocks are not headings."""
    anchors, seen, in_code = set(), {}, False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        heading = None if in_code else re.match(r"#{1,6} (.*)", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_the_page_is_under_300_lines_and_says_where_its_history_is():
    text = STATUS.read_text()
    assert len(text.splitlines()) < 300
    assert "git log -p docs/STATUS.md" in text


def test_every_path_and_test_the_page_names_exists():
    text = STATUS.read_text()
    paths = named_paths(text)
    assert "tests/unit/test_rundir.py" in paths and "examples/chat_cpu.yaml" in paths  # the scan finds what it checks
    # code spans name paths from the repository's root, the page's links from docs/ (an anchor after the file)
    missing = [p for p in paths if not any(ROOT.glob(p)) and not (DOCS / p.split("#")[0]).is_file()]
    assert not missing, f"docs/STATUS.md names paths that do not exist: {missing}"
    tests = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", text)
    assert tests, "the page names tests by their node id"
    absent = [f"{f}::{name}" for f, name in tests if not re.search(rf"^def {name}\(", (ROOT / f).read_text(), re.M)]
    assert not absent, f"docs/STATUS.md names tests that do not exist: {absent}"


def test_every_link_to_a_section_lands_on_a_heading():
    anchors = {doc.name: heading_anchors(doc.read_text()) for doc in (STATUS, DOCS / "benchmarks.md")}
    broken = []
    for doc in (STATUS, DOCS / "benchmarks.md", DOCS / "DESIGN.md", ROOT / "README.md"):
        for target, anchor in re.findall(r"\]\(([\w./-]*?)#([\w-]+)\)", doc.read_text()):
            name = Path(target).name if target else doc.name
            if name in anchors and anchor not in anchors[name]:
                broken.append(f"{doc.name}: {target}#{anchor}")
    assert not broken, f"links to headings that do not exist: {broken}"
    assert "the-real-model-smollm2-135m-instruct" in anchors["benchmarks.md"]  # what the page links to is there
