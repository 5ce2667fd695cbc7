"""The documentation holds together: a README a newcomer reads in minutes, relative links that
resolve (file and #anchor) in README.md and every page under docs/, a docs index that names every
page, and `make help` listing every documented target once, under one of its four groups."""
from __future__ import annotations

import re
import shutil
import subprocess
import unicodedata
from pathlib import Path

import pytest

from experiments.shared.files import REPO

README_MAX_LINES = 300
GROUPS = ("reproduce", "study", "operate", "develop")

FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+).*?\1")
# [text](target) and ![alt](target); the text may hold one level of brackets
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")


def prose_lines(text: str):
    """The lines of a markdown text outside fenced code blocks, code spans blanked."""
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield CODE_SPAN.sub("", line)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the text without markup, lower case, punctuation other
    than - and _ dropped, spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)      # a link: its text
    text = text.replace("`", "").lower()
    text = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor a page defines: its headings' slugs (a repeated one gets -1, -2, ...) and
    explicit ``<a id="...">`` / ``<a name="...">``."""
    found, seen = set(), {}
    text = page.read_text()
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        found.update(HTML_ANCHOR.findall(line))
        m = HEADING.match(line)
        if m:
            s = slug(m.group(2))
            n = seen.get(s, 0)
            seen[s] = n + 1
            found.add(s if n == 0 else f"{s}-{n}")
    return found


def broken_links(page: Path) -> list[str]:
    """The relative links of a markdown page that do not resolve: the file (or folder) must
    exist, and an #anchor into a markdown page must be one of that page's anchors."""
    bad = []
    for line in prose_lines(page.read_text()):
        for target in LINK.findall(line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):      # http:, https:, mailto: ...
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{page.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{page.name}: {target} (no heading #{anchor} in {dest.name})")
    return bad


def doc_pages() -> list[Path]:
    return [REPO / "README.md"] + sorted((REPO / "docs").rglob("*.md"))


def test_the_readme_is_short():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"


@pytest.mark.parametrize("page", doc_pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []


def test_the_readme_indexes_every_docs_page():
    """Every page under docs/ is linked from the README (its docs index)."""
    readme = REPO / "README.md"
    linked = {(REPO / t.partition("#")[0]).resolve()
              for line in prose_lines(readme.read_text()) for t in LINK.findall(line)}
    missing = [str(p.relative_to(REPO)) for p in sorted((REPO / "docs").rglob("*.md"))
               if p.resolve() not in linked]
    assert missing == []


def test_the_link_check_finds_a_missing_file_and_a_missing_anchor(tmp_path):
    """The checker itself: a link to a missing page, and an anchor no heading has, are reported;
    a heading's GitHub slug, an <a id>, a folder and an external URL are not; nothing inside
    code is read."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "other.md").write_text(
        "# Title\n\n## The `gluon.optim` loop: B = 64, 2-core\n\n<a id=\"exit-codes\"></a>\n"
        "```\n## not a heading\n```\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#the-gluonoptim-loop-b--64-2-core) [ok](other.md#exit-codes) [ok](sub/)\n"
        "[ok](https://example.org/x.md#y) [self](#here) ![img](other.md)\n\n## Here\n\n"
        "`[in code](nowhere.md)`\n```\n[in a block](nowhere.md)\n```\n"
        "[gone](missing.md) [bad anchor](other.md#not-a-heading) [bad self](#nowhere)\n")
    assert broken_links(page) == ["page.md: missing.md (no such file)",
                                  "page.md: other.md#not-a-heading (no heading #not-a-heading in other.md)",
                                  "page.md: #nowhere (no heading #nowhere in page.md)"]


def documented_targets(makefile: Path) -> list[str]:
    return re.findall(r"^([a-z0-9-]+):.*## ", makefile.read_text(), flags=re.M)


def make_help(*makefiles: Path) -> dict[str, list[str]]:
    """`make help`'s output as group -> targets, in the order printed."""
    if shutil.which("make") is None:
        pytest.skip("no make")
    args = [a for f in makefiles for a in ("-f", str(f))]
    p = subprocess.run(["make", "-s", "--no-print-directory", *args, "help"], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    groups, current = {}, None
    for line in p.stdout.splitlines():
        if not line.strip():
            continue
        m = re.match(r"^([a-z]+): ", line)
        if m:
            current = m.group(1)
            assert current not in groups, f"group {current} printed twice"
            groups[current] = []
            continue
        m = re.match(r"^  make (\S+)\s+\S", line)
        assert m and current, f"unexpected line in make help: {line!r}"
        groups[current].append(m.group(1))
    return groups


def test_make_help_lists_every_documented_target_once_under_one_of_four_groups():
    """Every target with a ``## `` comment names its group, and `make help` prints it once,
    under that group; the groups come in their order, none else (no "ungrouped")."""
    groups = make_help(REPO / "Makefile")
    assert tuple(groups) == GROUPS
    printed = [t for targets in groups.values() for t in targets]
    assert sorted(printed) == sorted(set(printed)), "a target printed twice"
    assert sorted(printed) == sorted(documented_targets(REPO / "Makefile"))
    assert {"fig2", "verify"} <= set(groups["reproduce"])
    assert {"test", "gpu-check"} <= set(groups["develop"])


def test_make_help_shows_a_target_without_a_group_as_ungrouped(tmp_path):
    """A ``## `` comment without a known group is not lost: it is printed under "ungrouped",
    which the test above refuses."""
    extra = tmp_path / "extra.mk"
    extra.write_text("new-target:  ## does something\n\t@true\n"
                     "odd-target:  ## [someday] does something else\n\t@true\n")
    groups = make_help(REPO / "Makefile", extra)
    assert groups["ungrouped"] == ["new-target", "odd-target"]
    assert tuple(groups)[:-1] == GROUPS
