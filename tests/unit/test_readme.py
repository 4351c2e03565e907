"""The README is a page a newcomer reads to the end (issue 51, item 9): at most 300 lines,
and every relative link in it leads to a file that exists and, with a `#fragment`, to a
heading there (GitHub's anchor for it), so moving detail into docs/ cannot leave it dangling.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_LINES = 300

# [text](target) and [text](target "title"); images too. Autolinks (<https://...>) are absolute.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks (a link or heading in code is not one)."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped (hyphens and
    underscores kept), spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in a markdown file, with GitHub's -1, -2 for repeats."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose_lines(path.read_text()):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(path: Path) -> list[str]:
    """Each relative link in `path` whose file or heading anchor does not exist, as
    "target: why"."""
    problems = []
    for line in prose_lines(path.read_text()):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file_part, _, fragment = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                problems.append(f"{target}: no such file")
                continue
            if fragment and dest.suffix == ".md" and fragment not in anchors(dest):
                problems.append(f"{target}: no heading #{fragment} in {dest.name}")
    return problems


def test_readme_is_at_most_300_lines() -> None:
    lines = README.read_text().count("\n")
    assert lines <= MAX_LINES, (
        f"README.md has {lines} lines (at most {MAX_LINES}): move detail into docs/"
    )


def test_every_relative_link_in_the_readme_resolves() -> None:
    assert broken_links(README) == []


def test_a_broken_link_or_anchor_is_found(tmp_path: Path) -> None:
    """The checker itself: a missing file and a missing heading are each reported, a heading
    with code and punctuation gets GitHub's anchor, and links inside code blocks are skipped."""
    doc = "# Title\n## The trained model: `artifacts`\n## Repeat\n## Repeat\n"
    (tmp_path / "doc.md").write_text(doc)
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](doc.md#the-trained-model-artifacts) [ok](doc.md#repeat-1) [ok](#top)\n"
        "[gone](missing.md) [no anchor](doc.md#nowhere) [web](https://example.com/x)\n"
        "```\n[in code](also-missing.md)\n```\n# Top\n"
    )
    assert broken_links(page) == [
        "missing.md: no such file",
        "doc.md#nowhere: no heading #nowhere in doc.md",
    ]


def test_every_relative_link_in_the_docs_resolves() -> None:
    """The pages the README links to keep their own links and anchors true as well (a
    heading renamed in docs/architecture.md once left its table of contents pointing
    nowhere)."""
    folders = ("docs", "examples", "bench", "deploy")
    pages = sorted(p for folder in folders for p in (ROOT / folder).rglob("*.md"))
    assert pages
    problems = {str(p.relative_to(ROOT)): b for p in pages if (b := broken_links(p))}
    assert problems == {}
