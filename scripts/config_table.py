"""Rewrite the README's configuration table from hvdtrain/config.py: python scripts/config_table.py"""

from pathlib import Path

from hvdtrain.config import describe_keys

START, END = "<!-- config-table:start -->", "<!-- config-table:end -->"


def shown(default) -> str:
    if isinstance(default, str):
        return repr(default)
    if isinstance(default, bool):
        return str(default).lower()
    return str(default)


def table() -> str:
    rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    rows += [f"| `{key}` | {tp} | `{shown(default)}` | {doc} |" for key, tp, default, doc in describe_keys()]
    return "\n".join(rows)


if __name__ == "__main__":
    readme = Path(__file__).resolve().parents[1] / "README.md"
    text = readme.read_text()
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{START}\n{table()}\n{END}{tail}")
