"""The documentation a newcomer reads: short where it must be, undated, each page saying first what it covers, and
every relative link (and every `docs/...` path in backticks) leading to a file and heading that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").rglob("*.md")])
DOCS = [page for page in PAGES if page.parent != ROOT]
# Pages other branches of the same change add (config files, own images, export): links to them are expected.
EXPECTED_PAGES = {"docs/settings.md", "docs/own-images.md", "docs/export.md"}

MONTHS = "January|February|March|April|May|June|July|August|September|October|November|December"
DATED = re.compile(rf"\b(\d{{1,2}} ({MONTHS})|({MONTHS}),? \d{{1,4}}|\d{{4}}-\d{{2}}-\d{{2}}|\d{{1,2}}:\d{{2}} UTC)\b"
                   r"|\b(main|commit) [0-9a-f]{7,40}\b")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
BACKTICKED_DOC = re.compile(r"`((?:docs/)[\w./-]+\.md)`")


def relative(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    found = set()
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower().replace(" ", "-")
            found.add("".join(c for c in title if c.isalnum() or c in "-_"))
    return found


def test_the_readme_is_under_9_kb_and_starts_with_make_run_and_make_test():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.encode()) < 9_000, f"README.md is {len(readme.encode())} bytes: keep it under 9 KB"
    commands = re.findall(r"^make \w[\w-]*", readme, re.MULTILINE)
    assert commands[:2] == ["make run", "make test"]


def test_the_privacy_guide_is_under_25_kb_and_states_the_adjacency():
    privacy = (ROOT / "docs" / "privacy.md").read_text(encoding="utf-8")
    assert len(privacy.encode()) < 25_000, f"docs/privacy.md is {len(privacy.encode())} bytes: keep it under 25 KB"
    flat = " ".join(privacy.split())
    assert "zero-out" in flat and "null sample" in flat
    assert "add-or-remove adjacency" in flat  # the accounting is said to be the same as for add-or-remove


def test_a_dated_heading_is_told_from_an_undated_one():
    dated = ["## 4 December: the first GPU figures", "### Measured on 2026-12-02", "## The run of December 2026",
             "### The second lease (main c5b3014)", "## Figures at 16:08 UTC"]
    undated = ["## iNaturalist 2021 and Places-365", "## Ingesting LAION-233M", "## The paper's run"]
    assert all(DATED.search(heading) for heading in dated)
    assert not any(DATED.search(heading) for heading in undated)


@pytest.mark.parametrize("page", [ROOT / "README.md", *DOCS], ids=relative)
def test_no_heading_or_line_in_the_docs_is_dated(page):
    lines = page.read_text(encoding="utf-8").splitlines()
    headings = [line for line in lines if line.startswith("#") and DATED.search(line)]
    assert not headings, f"{relative(page)}: dated headings {headings}: move dated content to CHANGELOG.md"
    dated = [line for line in lines if DATED.search(line)]
    assert not dated, f"{relative(page)}: dated lines {dated}: docs say what is true now; history goes to CHANGELOG.md"


@pytest.mark.parametrize("page", DOCS, ids=relative)
def test_each_page_says_first_what_it_covers(page):
    lines = [line for line in page.read_text(encoding="utf-8").splitlines()
             if line.strip() and not line.startswith("<!--")]
    assert lines[0].startswith("# "), f"{relative(page)} does not open with its title"
    assert lines[1][:1].isalpha(), f"{relative(page)}: the first paragraph after the title should say what it covers"


def broken_links(page: Path, root: Path, *, backticked: bool) -> list[str]:
    """The relative links of ``page`` that lead to no file below ``root`` or to no heading of it; with
    ``backticked``, also the `docs/...md` paths in backticks that name no file."""
    text = page.read_text(encoding="utf-8")
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if resolved.is_relative_to(root) and resolved.relative_to(root).as_posix() in EXPECTED_PAGES:
            continue
        if not resolved.exists() or (anchor and resolved.suffix == ".md" and anchor not in anchors(resolved)):
            broken.append(target)
    if backticked:
        broken += [path for path in BACKTICKED_DOC.findall(text)
                   if path not in EXPECTED_PAGES and not (root / path).exists()]
    return broken


@pytest.mark.parametrize("page", PAGES, ids=relative)
def test_every_relative_link_resolves(page):
    # The changelog names files as they were; only its links must lead somewhere.
    broken = broken_links(page, ROOT, backticked=page.name != "CHANGELOG.md")
    assert not broken, f"{relative(page)}: links to nothing: {broken}"


def test_the_link_check_sees_a_broken_link_and_a_missing_anchor(tmp_path):
    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other\n\n## Real heading\n")
    page.write_text("[ok](other.md#real-heading) [gone](missing.md) [anchor](other.md#nowhere) `docs/cli.md` "
                    "[soon](settings.md)\n")
    assert broken_links(page, tmp_path, backticked=True) == ["missing.md", "other.md#nowhere", "docs/cli.md"]
