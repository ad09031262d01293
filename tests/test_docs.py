"""The README and the book (docs/, mdBook) hold together: every relative
link resolves to a file, every `#anchor` to a heading of its target (by
mdBook's rule for ids and by GitHub's, since the pages are read in both
places), every page is in SUMMARY.md, the README stays short, and nothing
points outside the repository. Needs no build."""
import re
import unicodedata

import pytest

from conftest import ROOT

DOCS = ROOT / "docs"
SRC = DOCS / "src"
README = ROOT / "README.md"
PAGES = sorted(SRC.rglob("*.md"))
README_MAX_LINES = 250

FENCE = re.compile(r"^\s*(```|~~~)")
COMMENT = re.compile(r"<!--.*?-->", re.S)
# A code span: backticks, then anything but a blank line, then as many backticks.
CODE_SPAN = re.compile(r"(`+)((?:(?!\n[ \t]*\n).)+?)(?<!`)\1(?!`)", re.S)
# [text](target) and ![alt](target), the text over several lines or not.
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^[ ]{0,3}\[[^\]]+\]:[ \t]*<?(\S+?)>?(?:\s|$)", re.M)
INCLUDE = re.compile(r"\{\{#(?:include|rustdoc_include)\s+([^\s}:]+)")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
EXPLICIT_ID = re.compile(r"\s*\{#([^}\s]+)[^}]*\}\s*$")


def blank(match) -> str:
    """What replaces a match: its newlines only, so line numbers stay."""
    return "\n" * match.group(0).count("\n")


def prose(text: str) -> str:
    """The text without fenced code blocks and HTML comments (each line kept,
    emptied)."""
    lines = []
    fenced = False
    for line in text.split("\n"):
        if FENCE.match(line):
            fenced = not fenced
            lines.append("")
        else:
            lines.append("" if fenced else line)
    return COMMENT.sub(blank, "\n".join(lines))


def links(path):
    """(line number, target, is an include) of every link and include in a
    Markdown file."""
    def line_of(text, at):
        return text.count("\n", 0, at) + 1

    raw = COMMENT.sub(blank, path.read_text())
    # mdBook includes files in code blocks too.
    found = [(line_of(raw, m.start()), m.group(1), True) for m in INCLUDE.finditer(raw)]
    text = CODE_SPAN.sub(blank, prose(raw))
    found += [(line_of(text, m.start()), m.group(1), False) for m in INLINE_LINK.finditer(text)]
    found += [(line_of(text, m.start()), m.group(1), False) for m in REFERENCE_DEF.finditer(text)]
    return sorted(found)


def heading_text(markdown: str, smart_punctuation: bool) -> str:
    """A heading's text as rendered: code spans keep their content, links
    their text, emphasis and inline HTML go. mdBook turns `--` into an en
    dash and `---` into an em dash outside code (smart punctuation)."""
    parts = []
    last = 0
    for m in CODE_SPAN.finditer(markdown):
        parts.append((markdown[last:m.start()], False))
        parts.append((m.group(2).strip() if m.group(2).strip() else m.group(2), True))
        last = m.end()
    parts.append((markdown[last:], False))
    out = []
    for text, code in parts:
        if not code:
            text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
            text = re.sub(r"<[^>]+>", "", text)
            text = re.sub(r"(\*+|(?<!\w)_+|_+(?!\w))", "", text)
            text = text.replace("\\", "")
            if smart_punctuation:
                text = text.replace("---", "\u2014").replace("--", "\u2013")
        out.append(text)
    return "".join(out)


def mdbook_slug(text: str) -> str:
    """mdbook-html 0.5's `id_from_content`."""
    kept = []
    for ch in text.strip().lower():
        if ch.isalnum() or ch in "_-":
            kept.append(ch)
        elif ch.isspace():
            kept.append("-")
    return "".join(kept)


def github_slug(text: str) -> str:
    """GitHub's heading anchors (github-slugger): lower case, drop what is
    not a letter, a number, a space, `-` or `_`, spaces to `-`."""
    kept = []
    for ch in text.lower():
        category = unicodedata.category(ch)
        if ch in " -_" or category[0] in "LN" or category == "Mn":
            kept.append(ch)
    return "".join(kept).replace(" ", "-")


def anchors(path, slug, smart_punctuation) -> set:
    """The ids of a file's headings under one slug rule; a repeated id gets
    -1, -2, … as both mdBook and GitHub number them."""
    seen = set()
    for line in prose(path.read_text()).split("\n"):
        m = HEADING.match(line)
        if not m:
            continue
        text = m.group(2)
        explicit = EXPLICIT_ID.search(text)
        if explicit and path.is_relative_to(SRC):
            seen.add(explicit.group(1))
            continue
        base = slug(heading_text(text, smart_punctuation))
        candidate, n = base, 0
        while candidate in seen:
            n += 1
            candidate = f"{base}-{n}"
        seen.add(candidate)
    return seen


def problems_in(path) -> list:
    """What is wrong with the links of one file, one message each."""
    problems = []
    in_book = path.is_relative_to(SRC)
    where = path.relative_to(ROOT)
    for number, target, is_include in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        destination = (path.parent / file_part).resolve() if file_part else path
        if not destination.is_relative_to(ROOT):
            problems.append(f"{where}:{number}: {target} points outside the repository")
            continue
        if not destination.exists():
            problems.append(f"{where}:{number}: {target}: no such file")
            continue
        if in_book and not is_include and not destination.is_relative_to(SRC):
            problems.append(f"{where}:{number}: {target} leaves docs/src, which is all the built book holds")
            continue
        if not anchor:
            continue
        if destination.suffix != ".md" or destination.is_dir():
            problems.append(f"{where}:{number}: {target}: an anchor into a file that is not Markdown")
            continue
        rules = [("GitHub", github_slug, False)]
        if destination.is_relative_to(SRC):
            rules.append(("mdBook", mdbook_slug, True))
        for rule, slug, smart in rules:
            if anchor not in anchors(destination, slug, smart):
                problems.append(f"{where}:{number}: {target}: no heading with the id {anchor!r} by {rule}'s rule")
    return problems


def summary_pages() -> set:
    return {(SRC / target.partition("#")[0]).resolve() for _, target, _ in links(SRC / "SUMMARY.md")}


@pytest.mark.parametrize("path", [README, *PAGES], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves(path):
    problems = problems_in(path)
    assert not problems, "\n".join(problems)


def test_every_page_is_in_the_summary():
    listed = summary_pages()
    missing = [str(p.relative_to(ROOT)) for p in PAGES if p.name != "SUMMARY.md" and p.resolve() not in listed]
    assert not missing, f"pages missing from docs/src/SUMMARY.md: {missing}"
    absent = [str(p.relative_to(ROOT)) for p in listed if not p.exists()]
    assert not absent, f"SUMMARY.md lists pages that do not exist: {absent}"


def test_the_readme_is_short():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; at most {README_MAX_LINES}: move the rest into docs/"


def test_nothing_points_at_the_shared_folder():
    files = [README] + [p for p in DOCS.rglob("*") if p.is_file() and p.suffix in {".md", ".toml", ".txt", ".html", ".css", ".js"}]
    found = []
    for path in files:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if "../shared" in line or "shared folder" in line.lower():
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "the repository's docs name a folder outside it:\n" + "\n".join(found)


def test_the_slug_rules():
    """The two rules on headings this book has, as mdBook 0.5 and GitHub render them."""
    heading = "Profile a run: `hearth run --profile DIR`"
    assert mdbook_slug(heading_text(heading, True)) == "profile-a-run-hearth-run---profile-dir"
    assert github_slug(heading_text(heading, False)) == "profile-a-run-hearth-run---profile-dir"
    assert github_slug(heading_text("A newcomer's first build", False)) == "a-newcomers-first-build"
    assert mdbook_slug(heading_text("Sharded data parallel (FSDP)", True)) == "sharded-data-parallel-fsdp"
    assert github_slug(heading_text("`plugin.toml`", False)) == "plugintoml"
    # Outside code, mdBook's smart punctuation turns `--` into a dash, which no id keeps.
    assert mdbook_slug(heading_text("a -- b", True)) == "a--b"
    assert github_slug(heading_text("a -- b", False)) == "a----b"
