"""The README stays a quick start and the docs a manual: the README is at most 1,500 words, no page
of the manual keeps a dated diary (dates, "today", "this evening", internal work-item numbers:
measurements go to benchmarks/results/ with their date), and every relative link and #anchor in
the README, the top-level pages and docs/ resolves."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README_WORDS = 1500
# Pages the manual's rules do not hold yet: docs/testing.md records the CI runs of the suite and is
# being rewritten apart.
DIARY_EXEMPT: set[str] = set()

DIARY = [
    (r"\b20\d\d-\d\d-\d\d\b", "a date"),
    (r"\b(?:this|that|yesterday) (?:evening|morning|afternoon|night)\b", "a time of day"),
    (r"\btoday(?:'s)?\b", "'today'"),
    (r"\byesterday\b", "'yesterday'"),
    (r"\b(?:stop|stops|submission|issue|issues) \d+\b", "an internal work-item number"),
    (r"(?<![\w/.-])#\d{2,}\b", "an internal issue number"),
]


def manual_pages() -> list[Path]:
    return sorted((ROOT / "docs").glob("*.md"))


def linked_pages() -> list[Path]:
    """Every page whose links are checked: the top-level Markdown files, docs/ and the results."""
    return [*sorted(ROOT.glob("*.md")), *manual_pages(), *sorted((ROOT / "benchmarks" / "results").glob("*.md")),
            ROOT / "docker" / "README.md"]


def without_code(text: str) -> str:
    """The text with fenced blocks blanked: a `# comment` there is no heading, a URL no link."""
    return re.sub(r"^(```|~~~).*?^\1", "", text, flags=re.M | re.S)


def diary_phrases(text: str) -> list[str]:
    """What in ``text`` tells when something happened. Dates inside a link's target (a result's file
    name, benchmarks/results/<topic>_<hardware>_<date>.md) are a name, not a date in the prose, and
    a link to another project's issue or pull request (``[#3998](https://github.com/...)``) is theirs."""
    prose = re.sub(r"\[[^\]]*\]\(https?://[^)\s]*\)", "[]()", text)
    prose = re.sub(r"\]\([^)\s]*\)", "]()", prose)
    prose = re.sub(r"`[^`\n]*benchmarks/results/[^`\n]*`", "``", prose)
    found = []
    for pattern, what in DIARY:
        for match in re.finditer(pattern, prose, flags=re.I):
            line = prose.count("\n", 0, match.start()) + 1
            found.append(f"line {line}: {what} ({match.group(0)!r})")
    return found


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: links and code marks dropped, lowercase, punctuation other
    than '-' and '_' removed, each space a '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", without_code(page.read_text()), flags=re.M):
        slug = github_slug(heading)
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def broken_links(page: Path) -> list[str]:
    """Every relative link of ``page`` whose file does not exist, or whose #anchor names no heading."""
    problems = []
    text = re.sub(r"`[^`\n]*`", "``", without_code(page.read_text()))
    for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?(?:\s+\"[^\"]*\")?\)", text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        linked = (page.parent / target).resolve() if target else page
        if not linked.exists():
            problems.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            problems.append(f"{target}#{anchor}: no such heading")
    return problems


def test_readme_is_at_most_1500_words():
    words = len((ROOT / "README.md").read_text().split())
    assert words <= README_WORDS, f"README.md has {words} words (at most {README_WORDS}): move detail to docs/"


def test_manual_keeps_no_diary():
    problems = []
    for page in [ROOT / "README.md", *manual_pages()]:
        name = page.relative_to(ROOT).as_posix()
        if name not in DIARY_EXEMPT:
            problems += [f"{name} {found}" for found in diary_phrases(page.read_text())]
    assert not problems, ("say what is true now; measurements go to benchmarks/results/ with their date:\n"
                          + "\n".join(problems))


def test_links_and_anchors_resolve():
    problems = []
    for page in linked_pages():
        problems += [f"{page.relative_to(ROOT)}: {problem}" for problem in broken_links(page)]
    assert not problems, "\n".join(problems)


def test_the_checks_see_what_they_check(tmp_path):
    """Not vacuous: a date, 'this evening', a work-item number and a broken link or anchor are found;
    a result's dated file name, another project's issue and a good anchor are not."""
    assert len(diary_phrases("Measured on 2026-11-23, this evening, for issue 34 (#12).")) == 4
    assert diary_phrases("[r](../benchmarks/results/x_y_2026-11-23.md), horovod/horovod#3868, NVIDIA/DALI#5274, "
                         "[#3998](https://github.com/horovod/horovod/pull/3998)") == []
    assert github_slug("Decoding on the GPU (`data.decoder`)") == "decoding-on-the-gpu-datadecoder"
    assert github_slug("From pytorch/examples' imagenet/main.py") == "from-pytorchexamples-imagenetmainpy"
    (tmp_path / "other.md").write_text("# Other\n\n## A section, twice\n\n## A section, twice\n")
    page = tmp_path / "page.md"
    page.write_text("# Page\n\n[ok](other.md#a-section-twice) [ok](other.md#a-section-twice-1) [ok](#page)\n"
                    "```\n[not a link](missing.md)\n```\n"
                    "[gone](missing.md) [bad](other.md#no-such) [web](https://example.com/x.md)\n")
    assert broken_links(page) == ["missing.md: no such file", "other.md#no-such: no such heading"]
