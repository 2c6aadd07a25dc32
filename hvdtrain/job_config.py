"""A job's config: defaults < YAML file < ``key=value`` overrides, the output folder named, the task's
own section mounted, every section checked.

The config (hvdtrain/config) builds and checks the sections and knows no task and no job: it imports
no other part of hvdtrain. Which section a task owns is the tasks' knowledge (tasks/registry.py), and
where a job writes is the run's (``output.dir=auto``: train/run_folder.py). This module joins the
three for whoever starts or checks a job: the CLI, the Python API, the launchers' checks, the tools.

Light on purpose: the tasks, and torch with them, are imported only once a config is checked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .config import Config, apply_override, check_config, read_config
from .config import describe_keys as describe_config_keys
from .config.files import resolve_config_path
from .train.run_folder import resolve_output_dir


def load_config(config_file: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                check: bool = True) -> Config:
    """Defaults, then the YAML file, then the overrides; the output folder named; the task's section
    mounted; validated. ``check=False`` leaves the last three to the caller, who may name the task
    yet (api.build_config)."""
    cfg = read_config(config_file)
    from_file = cfg.output.dir
    for override in overrides:
        apply_override(cfg, override)
    if check:
        config_name = resolve_config_path(config_file).stem if config_file else None
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
    """Mount the task's own section (``cfg.task`` decides which: tasks/registry.py), then check every
    section, each problem in one line (config.check_config)."""
    from .tasks import registry

    section, settings = registry.settings_of(cfg.task)
    check_config(cfg, section, settings, known_tasks=registry.TASKS)


def describe_keys(with_tasks: bool = True) -> list[tuple[str, str, Any, str]]:
    """(key, type, default, doc) for every core key and, with ``with_tasks``, every key of the shipped
    tasks' own sections (``recommendation.embedding_dim``): docs/config.md is generated from this."""
    sections = []
    if with_tasks:
        from .tasks import registry

        sections = [registry.settings_of(name) for name in registry.TASKS]
    return describe_config_keys([(section, settings) for section, settings in sections
                                 if section and settings is not None])
