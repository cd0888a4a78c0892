"""The README and docs/ link to pages and sections that exist (GitHub's heading anchors)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def anchors(page: Path) -> set[str]:
    """GitHub's slugs of a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(encoding="utf-8"), flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_every_relative_link_names_a_file_and_a_heading_that_exist():
    checked = 0
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
            if re.match(r"^[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            assert linked.exists(), f"{page.name}: {target}"
            if anchor and linked.suffix == ".md":
                assert anchor in anchors(linked), f"{page.name}: {target} (headings: {sorted(anchors(linked))})"
            checked += 1
    assert checked >= 10


def test_every_table_is_whole():
    """A Markdown table is a header, a separator and its rows, after a blank line: a row left after a paragraph
    (docs/precision.md's loss-scaling table once had one) renders as text."""
    broken = []
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").splitlines()
        in_code = False
        for i, line in enumerate(lines):
            if line.startswith("```"):
                in_code = not in_code
            if in_code or not line.startswith("|") or (i and lines[i - 1].startswith("|")):
                continue
            starts_a_table = i + 1 < len(lines) and re.match(r"^\|(\s*:?-+:?\s*\|)+\s*$", lines[i + 1])
            if not starts_a_table or (i and lines[i - 1].strip()):
                broken.append(f"{page.name}:{i + 1}: {line[:60]}")
    assert not broken, broken


def test_every_extra_ampctl_recommends_is_in_the_readmes_install_block():
    """What a description or a refusal tells a user to install (`pip install "ampctl[torchao]"`) the README's install
    block installs too: [torchao] was missing while `ampctl list` recommended it."""
    sources = [*(REPO / "ampctl").rglob("*.py"), *(REPO / "ampctl" / "conf").rglob("*.yaml")]
    named = {extra for path in sources for extra in re.findall(r"ampctl\[([a-z0-9_-]+)\]", path.read_text())}
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    install = readme[readme.index("## Install"):readme.index("## A two-minute tour")]
    listed = set(re.findall(r"\.\[([a-z0-9_-]+)\]", install)) | set(re.findall(r"\[([a-z0-9_-]+)\]", install))
    assert named and not named - listed, sorted(named - listed)
