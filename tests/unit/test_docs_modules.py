"""The docs name the code as it is: docs/architecture.md's "Where things live" tables list every
module of the package and every shipped config, and neither they nor the README name a file that
does not exist; docs/architecture.md's ``module.name`` references resolve, in the module that
defines them."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "hvdtrain"

# Class names docs/architecture.md uses without their module.
CLASSES = {"RunState": "state", "Position": "state", "StepSettings": "engine", "Run": "run", "Task": "tasks.base",
           "DataEnv": "tasks.base"}


def package_modules() -> set[str]:
    """Every module of the package (hvdtrain/**/*.py), as paths from the repository root."""
    return {path.relative_to(ROOT).as_posix() for path in PACKAGE.rglob("*.py") if "__pycache__" not in path.parts}


def dotted_modules() -> dict[str, str]:
    """A doc's short name of a module -> its dotted path under hvdtrain: every module and package by
    its path (``train.run``, ``data.image``), and by its file name alone where that is unique
    (``trainer`` for ``train.trainer``; not ``build``, which optim/ and model/ both have)."""
    paths = {}
    for path in PACKAGE.rglob("*.py"):
        if "__pycache__" in path.parts:
            continue
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        if parts and parts[-1] != "__main__":
            paths[".".join(parts)] = ".".join(parts)
    stems: dict[str, list[str]] = {}
    for dotted in paths:
        stems.setdefault(dotted.rsplit(".", 1)[-1], []).append(dotted)
    short = {stem: found[0] for stem, found in stems.items() if len(found) == 1}
    return {**short, **paths}


def shipped_configs() -> set[str]:
    return {path.relative_to(ROOT).as_posix() for path in (PACKAGE / "configs").glob("*.yaml")}


def where_things_live(text: str) -> str:
    """docs/architecture.md's section that maps the code: from its heading to the next one."""
    return text.split("\n## Where things live\n", 1)[1].split("\n## ", 1)[0]


def first_cells(section: str) -> list[str]:
    """The first cell of every table row of a section (header and separator rows left out)."""
    cells = []
    for line in section.splitlines():
        if line.startswith("|") and not line.startswith("| ---"):
            cells.append(line.split("|")[1].strip())
    return cells[1:] if cells else cells


def listed_paths(section: str) -> set[str]:
    """Every hvdtrain/... file a row of the section's tables names in its first cell."""
    return {name for cell in first_cells(section) for name in re.findall(r"`(hvdtrain/[^`]+)`", cell)}


def test_architecture_lists_every_module_and_config():
    listed = listed_paths(where_things_live(ARCHITECTURE.read_text()))
    missing = (package_modules() | shipped_configs()) - listed
    assert not missing, f"docs/architecture.md 'Where things live' does not list {sorted(missing)}"


def test_docs_name_no_missing_module_file():
    for doc in (README, ARCHITECTURE):
        text = doc.read_text()
        named = set(re.findall(r"hvdtrain/[\w/]+\.(?:py|yaml)\b", text))
        absent = sorted(path for path in named if not (ROOT / path).exists())
        assert not absent, f"{doc.relative_to(ROOT)} names files that do not exist: {absent}"
    section = where_things_live(ARCHITECTURE.read_text())
    absent = sorted(path for path in listed_paths(section) if not (ROOT / path).exists())
    assert not absent, f"docs/architecture.md 'Where things live' names files that do not exist: {absent}"
    for cell in first_cells(section):
        for name in re.findall(r"`([^`]+\.(?:py|yaml))`", cell):
            assert name.startswith("hvdtrain/"), f"docs/architecture.md row '{cell}': name modules by their path"


def test_the_check_sees_a_missing_row():
    """The tables' parser is not vacuous: dropping a row is noticed."""
    section = where_things_live(ARCHITECTURE.read_text())
    row = next(line for line in section.splitlines() if line.startswith("| `hvdtrain/data/shards/tar.py`"))
    assert "hvdtrain/data/shards/tar.py" in listed_paths(section)
    assert "hvdtrain/data/shards/tar.py" not in listed_paths(section.replace(row + "\n", ""))


def module_names() -> set[str]:
    """Names a doc may use as the first part of ``module.name``: hvdtrain's modules and packages."""
    return {name.split(".")[0] for name in dotted_modules()} | {"hvdtrain"}


def is_config_key(dotted: str) -> bool:
    from hvdtrain.config import Config

    node: object = Config()
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(node) or part not in {f.name for f in dataclasses.fields(node)}:
            return False
        node = getattr(node, part)
    return True


def has_member(owner: object, name: str) -> bool:
    """An attribute, or a dataclass field without a default (which is no class attribute)."""
    if hasattr(owner, name):
        return True
    return inspect.isclass(owner) and name in getattr(owner, "__annotations__", {})


def resolve(dotted: str) -> str | None:
    """None when ``dotted`` names something that exists where it says; else what is wrong."""
    parts = dotted.split(".")
    if parts[0] in CLASSES:
        parts = [CLASSES[parts[0]], *parts]
    short = dotted_modules()
    if parts[0] in short:
        parts = [*short[parts[0]].split("."), *parts[1:]]
    if parts[0] != "hvdtrain":
        parts = ["hvdtrain", *parts]
    for split in range(len(parts), 0, -1):
        try:
            owner: object = importlib.import_module(".".join(parts[:split]))
            break
        except ModuleNotFoundError:
            continue
    module_name = ".".join(parts[:split])
    for part in parts[split:]:
        if not has_member(owner, part):
            return f"'{dotted}': {type(owner).__name__} {getattr(owner, '__name__', owner)} has no '{part}'"
        if not hasattr(owner, part):  # a dataclass field: nothing further to check
            return None
        found = getattr(owner, part)
        defined_in = getattr(found, "__module__", None)
        # A module's function or class must live in the module the doc names (run.build_model was
        # builders.build_model imported into run), except the package's public re-exports.
        defines = inspect.isfunction(found) or inspect.isclass(found)
        if inspect.ismodule(owner) and module_name != "hvdtrain" and defines and defined_in != module_name:
            return f"'{dotted}' is defined in {defined_in}, not {module_name}"
        owner = found
    return None


def code_references(text: str) -> set[str]:
    """Dotted names in backticks whose first part is an hvdtrain module or class (``x.y`` or ``x.y(...)``)."""
    found = set()
    prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)  # fenced blocks would pair the wrong backticks
    for code in re.findall(r"`([^`]+)`", prose):
        match = re.match(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(|$)", code)
        if match and match.group(1).endswith(".py"):
            continue  # a file name: test_architecture_names_only_existing_files
        if match and re.search(r"\.(?:jsonl?|lock|yaml|tsv|txt|png|pt)$", match.group(1)):
            continue  # a file a run writes (metrics.jsonl, run.lock), not a module's name
        if match and match.group(1).split(".")[0] in module_names() | set(CLASSES):
            found.add(match.group(1))
    return found


def test_architecture_names_exist_where_it_says():
    references = {name for name in code_references(ARCHITECTURE.read_text()) if not is_config_key(name)}
    assert len(references) > 30  # the parser found the page's references
    problems = sorted(filter(None, map(resolve, references)))
    assert not problems, "docs/architecture.md: " + "; ".join(problems)


def test_architecture_names_only_existing_files():
    prose = ARCHITECTURE.read_text()
    files = set(re.findall(r"`((?:[\w/]+/)?\w+\.py)`", prose))
    assert "comm/dist.py" in files
    absent = sorted(name for name in files if not any((base / name).is_file() for base in (PACKAGE, ROOT)))
    assert not absent, f"docs/architecture.md names files that do not exist: {absent}"


def test_the_name_check_sees_a_function_named_in_the_wrong_module():
    assert resolve("builders.build_model") is None
    assert resolve("run.build_model") == ("'run.build_model' is defined in hvdtrain.train.builders, "
                                          "not hvdtrain.train.run")
    assert resolve("run.no_such_function") is not None
    assert resolve("Run.task") is None and resolve("StepSettings.after_optimizer_step") is None
