"""Building a config: defaults < YAML file < ``key=value`` overrides, then the task's own section.

A config is built in two steps. The core sections (config/sections.py, run_sections.py) take their
keys at once; keys of any other top-level section wait, because which section is valid depends on
the task, and the task may be named last (``task=`` on the command line, or by the caller of ``evaluate``). Then
``validate`` mounts the task's section (``Task.settings`` under the task's ``name``: tasks/registry.py
says which class a ``task`` value names), sets the waiting keys on it, and checks the core sections
and the task's. A key in no section stops with one line that names the valid keys.

A config recorded by an earlier run (a checkpoint's, config.yaml) is read with ``stored=True``: keys
that have moved into a task's section since are carried over, and nothing is imported until the
caller has said which task it trusts (api.checkpoint_config).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import yaml

from ..train.run_folder import resolve_output_dir
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


def load_config(config_file: str | None = None, overrides: list[str] | tuple[str, ...] = (),
                check: bool = True) -> Config:
    """Defaults, then the YAML file, then the overrides; the task's section mounted; validated.
    ``check=False`` leaves the last two to the caller, who may name the task yet (api.build_config)."""
    cfg = Config()
    config_name = None
    if config_file:
        path = resolve_config_path(config_file)
        config_name = path.stem
        apply_mapping(cfg, read_config_file(path), source=str(path))
    from_file = cfg.output.dir
    for override in overrides:
        apply_override(cfg, override)
    if check:
        resolve_output(cfg, config_name, from_file=config_file is not None and cfg.output.dir == from_file
                       and not any(text.split("=", 1)[0].strip() == "output.dir" for text in overrides))
        validate(cfg)
    return cfg


def resolve_output(cfg: Config, config_name: str | None, from_file: bool) -> None:
    """``output.dir`` for this job (train/run_folder.py): the default folder for ``auto``, and a
    folder of the job's own inside one a config file names, under a scheduler."""
    cfg.output.dir = resolve_output_dir(cfg.output.dir, config_name=config_name,
                                        from_file=from_file and cfg.output.dir != "auto")


def validate(cfg: Config) -> None:
    """Mount the task's own section (``cfg.task`` decides which), then check every section, each
    problem in one line. ``cfg`` keeps its identity: a task that declares settings turns it into
    the config class that carries them (sections.config_type)."""
    from ..tasks import registry  # the task classes; the tasks import the config, not the reverse

    section, settings = registry.settings_of(cfg.task)
    bind_section(cfg, section, settings, known_tasks=registry.TASKS)
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


def from_dict(mapping: dict[str, Any], stored: bool = False, check: bool = True) -> Config:
    """A config from a nested mapping. ``stored``: a config an earlier run recorded (a checkpoint's):
    moved keys are carried over, and the task's section waits for ``validate``, which the caller runs
    once it has named the task it trusts (no code a checkpoint names is imported). ``check=False``
    leaves ``validate`` to the caller too."""
    cfg = Config()
    apply_mapping(cfg, migrate_moved_keys(mapping) if stored else mapping)
    if check and not stored:
        validate(cfg)
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
    from ..redact import mask_values

    return yaml.safe_dump(mask_values(to_dict(cfg)), sort_keys=False)


def describe_keys(with_tasks: bool = True) -> list[tuple[str, str, Any, str]]:
    """(key, type, default, doc) for every core key and, with ``with_tasks``, every key of the shipped
    tasks' own sections (``recommendation.embedding_dim``): docs/config.md is generated from this."""
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
            if dataclasses.is_dataclass(tp):
                walk(tp, f"{prefix}{name}.", value)
            else:
                rows.append((f"{prefix}{name}", type_name(tp), value, docs.get(name, "")))

    walk(Config, "", Config())
    if with_tasks:
        from ..tasks import registry

        for name in registry.TASKS:
            section, settings = registry.settings_of(name)
            if section:
                walk(settings, f"{section}.", settings())
    return rows


__all__ = ["apply_mapping", "apply_override", "load_config", "validate", "from_dict", "to_dict", "dump_yaml",
           "flatten", "describe_keys", "migrate_moved_keys", "task_section", "resolve_config_path"]
