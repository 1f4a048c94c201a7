"""The README and docs/ hold together: every link between the pages reaches a page and a heading
that exist, and every page is reachable from the README -- fast."""

from __future__ import annotations

import re
from pathlib import Path

from autograder.places import REPO_ROOT
from tests.readme_commands import pages

LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.MULTILINE | re.DOTALL)
    return {anchor(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


def links(page: Path) -> list[tuple[Path, str]]:
    """``(target page, anchor)`` of each link to a file of the repository."""
    found = []
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):
            continue  # another site
        path, _, fragment = target.partition("#")
        found.append(((page.parent / path).resolve() if path else page, fragment))
    return found


def test_every_link_between_the_pages_reaches_a_page_and_a_heading():
    documented = [*pages(), REPO_ROOT / "CHANGELOG.md"]
    broken = [f"{page.relative_to(REPO_ROOT)} -> {target.relative_to(REPO_ROOT)}#{fragment}"
              for page in documented for target, fragment in links(page)
              if not target.exists() or (fragment and fragment not in anchors(target))]
    assert not broken, broken


def test_every_page_is_reachable_from_the_readme():
    seen, pending = set(), [REPO_ROOT / "README.md"]
    while pending:
        page = pending.pop()
        if page in seen or page.suffix != ".md" or not page.exists():
            continue
        seen.add(page)
        pending += [target for target, _ in links(page)]
    assert set(pages()) - seen == set()
