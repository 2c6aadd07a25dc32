"""Rewrite the configuration table in docs/config.md from hvdtrain/config/ and the shipped tasks' sections:
python scripts/config_table.py

The table goes between the START and END markers of docs/config.md; everything else in the file is
left as written. tests/unit/test_readme.py loads this file (by path, not through sys.path) and fails
when the table there differs from table().
"""

from pathlib import Path

from hvdtrain.job_config import describe_keys

START, END = "<!-- config-table:start -->", "<!-- config-table:end -->"
CONFIG_DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def shown(default) -> str:
    if isinstance(default, str):
        return repr(default)
    if isinstance(default, bool):
        return str(default).lower()
    return str(default)


def table() -> str:
    """The markdown table of every config key: key, type, default, meaning."""
    rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    rows += [f"| `{key}` | {tp} | `{shown(default)}` | {doc} |" for key, tp, default, doc in describe_keys()]
    return "\n".join(rows)


def current_table(text: str) -> str:
    """The table found between the markers of ``text``."""
    return text.split(START, 1)[1].split(END, 1)[0].strip()


def with_table(text: str) -> str:
    """``text`` with the part between the markers replaced by table()."""
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{table()}\n{END}{tail}"


if __name__ == "__main__":
    CONFIG_DOC.write_text(with_table(CONFIG_DOC.read_text()))
    print(f"wrote {CONFIG_DOC}")
