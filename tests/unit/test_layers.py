"""The layering of hvdtrain as contracts over every import of the package (docs/architecture.md,
"Layers"): read with ``ast``, imports at the top of a module and inside its functions alike,
relative imports resolved. A broken contract fails with one line per import that breaks it:
``importer -> imported (path:line)``.

- hvdtrain.config imports nothing else of hvdtrain but CONFIG_LEAVES, standard-library leaves
  that import nothing of hvdtrain themselves;
- only hvdtrain/comm/ imports Horovod's training side (horovod.torch, horovod.common and anything
  else of horovod but horovod.runner, the launcher side, which launch/ and tools/ use to plan and
  check jobs without initializing Horovod);
- hvdtrain/fault/ does not import hvdtrain/train/;
- hvdtrain/data/ imports neither hvdtrain/train/ nor hvdtrain/tasks/;
- no import cycle between modules, counting imports inside functions.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "hvdtrain"

# What the config may import of the rest of hvdtrain: leaves of the standard library only.
CONFIG_LEAVES = frozenset({"hvdtrain.redact"})
# Horovod's launcher side: plans hosts and slots, runs rendezvous servers; it never initializes Horovod.
HOROVOD_LAUNCHER_SIDE = "horovod.runner"


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    path: Path
    line: int

    def __str__(self) -> str:
        return f"{self.importer} -> {self.imported} ({self.path.relative_to(REPO)}:{self.line})"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, path: Path) -> list[Import]:
    """Every import in the module, wherever it stands; ``from pkg import sub`` names the submodule
    where ``sub`` is one, the package otherwise."""
    found = []
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [Import(name, alias.name, path, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                found.append(Import(name, sub if sub in MODULES else source, path, node.lineno))
    return found


# One entry per import statement and module (``from x import a, b`` of one module counts once).
IMPORTS = list(dict.fromkeys(found for name, path in MODULES.items() for found in imports_of(name, path)))


def inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def broken(importers: str, forbidden) -> list[str]:
    return [str(found) for found in IMPORTS if inside(found.importer, importers) and forbidden(found.imported)]


def test_the_import_reader_sees_imports_inside_functions_and_resolves_relative_ones():
    # A check of the checker: known imports of the package, one at the top, one inside a function.
    mine = {(found.imported, found.line) for found in IMPORTS if found.importer == "hvdtrain.cli"}
    assert any(imported == "hvdtrain.job_config" for imported, _ in mine), mine
    function_level = [found for found in IMPORTS if found.importer == "hvdtrain.cli"
                      and found.imported.startswith("hvdtrain.tools.")]
    assert function_level, "cli imports its commands inside functions"
    assert len(MODULES) > 100 and len(IMPORTS) > 500


def test_the_config_imports_nothing_else_of_hvdtrain():
    problems = broken("hvdtrain.config", lambda imported: inside(imported, "hvdtrain")
                      and not inside(imported, "hvdtrain.config") and imported not in CONFIG_LEAVES)
    problems += broken(next(iter(CONFIG_LEAVES)), lambda imported: inside(imported, "hvdtrain"))
    assert not problems, "hvdtrain.config must not import the rest of hvdtrain:\n" + "\n".join(problems)


def test_only_comm_imports_horovods_training_side():
    def training_side(imported: str) -> bool:
        return inside(imported, "horovod") and not inside(imported, HOROVOD_LAUNCHER_SIDE)

    problems = [str(found) for found in IMPORTS
                if not inside(found.importer, "hvdtrain.comm") and training_side(found.imported)]
    assert not problems, "only hvdtrain/comm/ may import horovod (but horovod.runner):\n" + "\n".join(problems)


def test_fault_does_not_import_train():
    problems = broken("hvdtrain.fault", lambda imported: inside(imported, "hvdtrain.train"))
    assert not problems, "hvdtrain/fault/ must not import hvdtrain/train/:\n" + "\n".join(problems)


def test_data_imports_neither_train_nor_tasks():
    problems = broken("hvdtrain.data", lambda imported: inside(imported, "hvdtrain.train")
                      or inside(imported, "hvdtrain.tasks"))
    assert not problems, "hvdtrain/data/ must import neither train/ nor tasks/:\n" + "\n".join(problems)


def import_cycles() -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    graph = {name: sorted({found.imported for found in IMPORTS if found.importer == name
                           and found.imported in MODULES and found.imported != name}) for name in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def test_no_import_cycle_between_modules():
    lines = []
    for component in import_cycles():
        members = set(component)
        lines.append(f"a cycle of {len(component)} modules: {', '.join(component)}; their imports of each other:")
        lines += [f"  {found}" for found in IMPORTS if found.importer in members and found.imported in members
                  and found.importer != found.imported]
    assert not lines, "\n".join(lines)


# What a dist.engine=torch run loads of comm/: none of it may import horovod, not even inside a
# function (the facade loads comm/horovod_engine.py only when the Horovod engine is picked).
TORCH_ENGINE_SIDE = ("hvdtrain.comm.dist", "hvdtrain.comm.torch_engine", "hvdtrain.comm.torch_optimizer",
                     "hvdtrain.comm.objects", "hvdtrain.comm.buckets", "hvdtrain.comm.launcher_env")


def test_the_torch_engine_side_of_comm_imports_no_horovod():
    assert set(TORCH_ENGINE_SIDE) <= set(MODULES)
    problems = [str(found) for found in IMPORTS
                if found.importer in TORCH_ENGINE_SIDE and inside(found.imported, "horovod")]
    assert not problems, "the torch engine's modules must not import horovod:\n" + "\n".join(problems)
    loads = {found.imported for found in IMPORTS if found.importer == "hvdtrain.comm.dist"}
    assert "hvdtrain.comm.horovod_engine" in loads  # (inside a function: the check above sees those too)
