"""The README documents every config key with its current default."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
sys.path.insert(0, str(ROOT / "scripts"))

from config_table import END, START, table  # noqa: E402


def test_config_table_is_current():
    assert README.split(START, 1)[1].split(END, 1)[0].strip() == table(), \
        "README config table is stale: run python scripts/config_table.py"


def test_quick_start_is_two_make_commands():
    quick = README.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    assert [line.split()[0:2] for line in quick.strip().splitlines()] == [["make", "demo"], ["make", "test"]]
