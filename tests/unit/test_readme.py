"""The README keeps its quick start and links every doc page; docs/config.md lists every config key
with its current default."""

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def load_config_table():
    """scripts/config_table.py, loaded by file path (scripts/ is not a package and not on sys.path)."""
    spec = importlib.util.spec_from_file_location("config_table", ROOT / "scripts" / "config_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_config_table_is_current():
    config_table = load_config_table()
    assert config_table.CONFIG_DOC == ROOT / "docs" / "config.md"
    assert config_table.current_table(config_table.CONFIG_DOC.read_text()) == config_table.table(), \
        "docs/config.md config table is stale: run python scripts/config_table.py"


def test_quick_start_is_two_make_commands():
    quick = README.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    assert [line.split()[0:2] for line in quick.strip().splitlines()] == [["make", "demo"], ["make", "test"]]


def test_readme_links_every_doc_page():
    linked = set(re.findall(r"\]\((docs/[^)#\s]+\.md)", README))
    pages = {f"docs/{page.name}" for page in (ROOT / "docs").glob("*.md")}
    assert pages <= linked, f"README does not link {sorted(pages - linked)}"


def test_doc_links_resolve():
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links to missing {target}"
