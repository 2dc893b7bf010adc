"""Every relative link of the front door (README.md), docs/, models/ and eval/'s index resolves to a file of the
repository: moving a reference out of the README must not leave a dead link behind (issue 39)."""

from __future__ import annotations

import re
from pathlib import Path

from harness.core import project

ROOT = project.project_root()
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _docs() -> list[Path]:
    return [ROOT / "README.md", ROOT / "eval" / "README.md", *sorted((ROOT / "docs").glob("*.md")),
            *sorted((ROOT / "models").glob("*.md"))]


def dead_links(path: Path) -> list[str]:
    out = []
    for target in LINK.findall(path.read_text()):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        if not (path.parent / target).exists():
            out.append(target)
    return out


def test_relative_links_resolve() -> None:
    dead = {str(p.relative_to(ROOT)): d for p in _docs() if (d := dead_links(p))}
    assert dead == {}


def test_a_dead_link_is_found(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("")
    page.write_text("[ok](there.md) [ok too](there.md#part) [web](https://example.org) [gone](missing.md)")
    assert dead_links(page) == ["missing.md"]


def test_the_readme_is_a_front_door() -> None:
    """README at most ~150 lines (issue 39): the reference lives in docs/."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 160
