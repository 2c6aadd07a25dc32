"""The code speaks of the project alone: no comment, docstring or message cites an internal work item
("issue 36, point 2") that a reader of the repository cannot look up. tests/unit/test_docs.py holds
the manual and the results to the same rule."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("hvdtrain", "tests", "scripts", "benchmarks", "examples", "hostfiles", "docker", "third_party", ".ci")
SUFFIXES = {".py", ".sh", ".sbatch", ".yaml", ".yml", ".toml", ".patch", ""}
ITEM = re.compile(r"\b(?:issue|issues|stop|submission) \d+\b", re.I)
# This file and test_docs.py spell the pattern out to test it.
EXEMPT = {Path("tests/unit/test_item_numbers.py"), Path("tests/unit/test_docs.py")}


def cited_items() -> list[str]:
    found = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*")):
            relative = path.relative_to(ROOT)
            if not path.is_file() or path.suffix not in SUFFIXES or relative in EXEMPT or "results" in relative.parts:
                continue
            try:
                text = path.read_text()
            except UnicodeDecodeError:
                continue
            for number, line in enumerate(text.splitlines(), 1):
                if match := ITEM.search(line):
                    found.append(f"{relative}:{number}: {match.group(0)!r}")
    return found


def test_no_file_cites_an_internal_work_item():
    assert cited_items() == []


def test_the_check_finds_a_cited_item():
    assert ITEM.search("Secrets never show in argv (issue 36, point 2).")
    assert not ITEM.search("srun placed task 1 of node gpu02") and not ITEM.search("Horovod issue tracker")
