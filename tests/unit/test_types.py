"""The type check's reach is stated, not implied: every module of hvdtrain/ is either in mypy's
``files`` (pyproject.toml's ``[tool.mypy]``, checked by ``make lint`` and ``make test`` before any
test) or in the follow-up list beside it (``[tool.hvdtrain.types] not_yet_checked``), never in
both and never in neither; the contract modules are checked strictly; and the make targets run it."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
CHECKED = PYPROJECT["tool"]["mypy"]["files"]
NOT_YET = PYPROJECT["tool"]["hvdtrain"]["types"]["not_yet_checked"]
# Where the contracts live (the config, checkpoints, whose files are trusted): strict, flag by flag.
STRICT_MODULES = {"hvdtrain.config.*", "hvdtrain.checkpoint.*", "hvdtrain.ownership"}
STRICT_FLAGS = {"disallow_untyped_defs", "disallow_incomplete_defs", "disallow_untyped_calls",
                "disallow_any_generics", "warn_return_any"}


def covering(module: str, paths: list[str]) -> list[str]:
    return [path for path in paths if module == path or module.startswith(path.rstrip("/") + "/")]


def test_every_module_is_type_checked_or_listed_as_not_yet():
    modules = sorted(path.relative_to(REPO).as_posix() for path in (REPO / "hvdtrain").rglob("*.py")
                     if "__pycache__" not in path.parts)
    assert len(modules) > 100
    neither = [module for module in modules if not covering(module, CHECKED + NOT_YET)]
    both = [module for module in modules if covering(module, CHECKED) and covering(module, NOT_YET)]
    assert not neither, ("modules neither in [tool.mypy] files nor in [tool.hvdtrain.types] not_yet_checked "
                         "(pyproject.toml): " + ", ".join(neither))
    assert not both, "modules in both lists: take them off not_yet_checked: " + ", ".join(both)
    stale = [path for path in CHECKED + NOT_YET if not (REPO / path).exists()]
    assert not stale, "paths in the type check's lists that do not exist: " + ", ".join(stale)
    # Most of the package is checked already: the follow-up list only shrinks.
    assert len([module for module in modules if covering(module, CHECKED)]) >= 30


def test_the_contract_modules_are_checked_strictly_and_nothing_is_silenced():
    overrides = PYPROJECT["tool"]["mypy"]["overrides"]
    strict = [o for o in overrides if STRICT_MODULES <= set(o["module"])]
    assert strict and all(strict[0].get(flag) is True for flag in STRICT_FLAGS), strict
    assert not [o for o in overrides if o.get("ignore_errors")], "a module's errors silenced in [tool.mypy]"
    # Only third-party names may be taken as Any for want of stubs, never hvdtrain's own.
    untyped = [name for o in overrides if o.get("ignore_missing_imports") for name in o["module"]]
    assert untyped and not [name for name in untyped if name.startswith("hvdtrain")]


def test_lint_and_test_run_mypy_before_the_tests():
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    for target in ("lint", "test"):
        recipe = re.search(rf"^{target}: .*\n((?:\t.*\n)+)", makefile, re.M).group(1)
        assert "-m mypy" in recipe, f"make {target} does not run mypy"
        if "pytest" in recipe:
            assert recipe.index("-m mypy") < recipe.index("pytest")
    test_extra = " ".join(PYPROJECT["project"]["optional-dependencies"]["test"])
    assert re.search(r"\bmypy==\d", test_extra), "mypy is not pinned in the test extra"
