"""Building a config: defaults < YAML file < ``key=value`` overrides, then the task's own section.

A config is built in two steps. The core sections (config/sections.py, run_sections.py) take their
keys at once (``read_config``); keys of any other top-level section wait, because which section is
valid depends on the task, and the task may be named last (``task=`` on the command line, or by
the caller of ``evaluate``). Then ``check_config`` mounts the task's section (``Task.settings``
under the task's ``name``), sets the waiting keys on it, and checks the core sections and the
task's. A key in no section stops with one line that names the valid keys.

Which section a task owns is the tasks' knowledge (tasks/registry.py), and the config imports no
other part of hvdtrain: hvdtrain/job_config.py asks the registry and calls ``check_config``
(``load_config``, ``validate``).

A config recorded by an earlier run (a checkpoint's, config.yaml) is read with ``stored=True``: keys
that have moved into a task's section since are carried over, and nothing is imported until the
caller has said which task it trusts (api.checkpoint_config).
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Any, Iterable

import yaml

from ..redact import mask_values
from .checks import check_core
from .files import read_config_file, resolve_config_path
from .keys import ConfigError, field_types, set_key, type_name
from .root import MOVED_KEYS, Config, bind_section, task_section


def apply_mapping(cfg: Config, mapping: dict[str, Any], source: str = "config") -> None:
    """Apply a nested mapping (as read from YAML) onto ``cfg``."""
    if mapping is None:
        return
    if not isinstance(mapping, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections, got {type(mapping).__name__}")
    for key, value in mapping.items():
        set_key(cfg, str(key), value, from_text=False)


def apply_override(cfg: Config, text: str) -> None:
    """Apply one ``section.key=value`` override from the command line."""
    if "=" not in text:
        # A config file given without --config lands here: say how to give it.
        hint = f" (to read a config file, use --config {text})" if text.endswith((".yaml", ".yml")) else ""
        raise ConfigError(f"override '{text}' is not of the form section.key=value{hint}")
    key, value = text.split("=", 1)
    set_key(cfg, key.strip(), value.strip(), from_text=True)


def read_config(config_file: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults, then the YAML file, then the overrides; not yet checked (``check_config``: the
    caller may name the task yet, api.build_config)."""
    cfg = Config()
    if config_file:
        path = resolve_config_path(config_file)
        apply_mapping(cfg, read_config_file(path), source=str(path))
    for override in overrides:
        apply_override(cfg, override)
    return cfg


def check_config(cfg: Config, section: str, settings: type | None, known_tasks: Iterable[str] = ()) -> None:
    """Mount the task's own section (``section``, of the dataclass ``settings``; "" and None where the
    task declares none), then check every section, each problem in one line. ``cfg`` keeps its
    identity: a task that declares settings turns it into the config class that carries them
    (root.config_type). ``known_tasks``: the shipped tasks, whose sections a misplaced key may name."""
    bind_section(cfg, section, settings, known_tasks=known_tasks)
    check_core(cfg)
    if section:
        check = getattr(getattr(cfg, section), "validate", None)
        if check is not None:
            check(cfg)


def migrate_moved_keys(mapping: dict[str, Any]) -> dict[str, Any]:
    """A recorded config (nested) with the keys that moved into a task's section (MOVED_KEYS) carried
    over: into the section when the recorded task owns it, dropped otherwise (before the move, every
    run recorded every task's keys at their defaults)."""
    mapping = {key: dict(value) if isinstance(value, dict) else value for key, value in mapping.items()}
    task = mapping.get("task", Config.task)
    for old, new in MOVED_KEYS.items():
        section, key = old.split(".")
        if not isinstance(mapping.get(section), dict) or key not in mapping[section]:
            continue
        value = mapping[section].pop(key)
        new_section, new_key = new.split(".")
        if task == new_section and not (isinstance(mapping.get(new_section), dict) and new_key in mapping[new_section]):
            mapping.setdefault(new_section, {})[new_key] = value
    return mapping


def from_dict(mapping: dict[str, Any], stored: bool = False) -> Config:
    """A config from a nested mapping, not yet checked: the task's section waits for ``check_config``
    (job_config.validate), which the caller runs once it has named the task it trusts (no code a
    checkpoint names is imported). ``stored``: a config an earlier run recorded (a checkpoint's):
    moved keys are carried over."""
    cfg = Config()
    apply_mapping(cfg, migrate_moved_keys(mapping) if stored else mapping)
    return cfg


def flatten(mapping: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"train": {"epochs": 3}}`` -> ``{"train.epochs": 3}``."""
    flat: dict[str, Any] = {}
    for key, value in mapping.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Config) -> str:
    """The config as YAML for people and files (--print-config, config.yaml): a password in a URL
    shows as *** (redact.py)."""
    return yaml.safe_dump(mask_values(to_dict(cfg)), sort_keys=False)


def describe_keys(sections: Iterable[tuple[str, type]] = ()) -> list[tuple[str, str, Any, str]]:
    """(key, type, default, doc) for every core key and every key of the given task sections
    ((section, settings dataclass): ``recommendation.embedding_dim``); job_config.describe_keys
    adds the shipped tasks' for docs/config.md."""
    import ast

    rows = []

    def docs_of(cls: type) -> dict[str, str]:
        tree = ast.parse(inspect.getsource(cls))
        body = tree.body[0].body  # type: ignore[attr-defined]
        found = {}
        for node, after in zip(body, body[1:] + [None]):
            documented = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
            if isinstance(node, ast.AnnAssign) and documented:
                found[node.target.id] = " ".join(str(after.value.value).split())  # type: ignore[union-attr]
        return found

    def walk(cls: type, prefix: str, instance: Any) -> None:
        docs = docs_of(cls)
        for name, tp in field_types(cls).items():
            value = getattr(instance, name)
            if isinstance(tp, type) and dataclasses.is_dataclass(tp):
                walk(tp, f"{prefix}{name}.", value)
            else:
                rows.append((f"{prefix}{name}", type_name(tp), value, docs.get(name, "")))

    walk(Config, "", Config())
    for section, settings in sections:
        walk(settings, f"{section}.", settings())
    return rows


__all__ = ["apply_mapping", "apply_override", "read_config", "check_config", "from_dict", "to_dict", "dump_yaml",
           "flatten", "describe_keys", "migrate_moved_keys", "task_section", "resolve_config_path"]
