"""Config files: a path or the name of a shipped config, read as bounded, safe YAML."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from .keys import ConfigError

PACKAGED_CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def is_config_path(name_or_path: str | Path) -> bool:
    """Whether a ``--config`` value is a path (a Path, a name with a slash, or one ending in .yaml/.yml)
    rather than the name of a shipped config."""
    text = str(name_or_path)
    return isinstance(name_or_path, Path) or "/" in text or text.endswith((".yaml", ".yml"))


def resolve_config_path(name_or_path: str | Path) -> Path:
    """A path as given (``./my.yaml``, ``runs/x/config.yaml``), or the name of a config shipped with
    hvdtrain (``debug``, ``demo``...).

    A name always means the shipped config, never a file of that name in the working folder: a user
    who starts a job in a shared folder must not run a config (which can name a task file to import)
    that another user left there. A file is taken only when given as a path."""
    if is_config_path(name_or_path):
        path = Path(name_or_path)
        if path.is_file():
            return path
        raise ConfigError(f"config file '{name_or_path}' not found (a path is relative to the working folder, "
                          f"{Path.cwd()})")
    packaged = PACKAGED_CONFIGS / f"{name_or_path}.yaml"
    if packaged.is_file():
        return packaged
    shipped = ", ".join(sorted(p.stem for p in PACKAGED_CONFIGS.glob("*.yaml")))
    raise ConfigError(f"no shipped config named '{name_or_path}' (shipped: {shipped}); a file of your own is given "
                      f"as a path, e.g. --config ./{name_or_path}.yaml")


# A config file is a few KB of keys (the largest shipped one is 2 KB). Larger files are refused before
# parsing: PyYAML took 32 s and 854 MB on an 80 MB one, and reads about 100 KB/s of dense YAML. So is
# nesting deeper than any config needs (sections are at most 3 deep): PyYAML's composer recurses
# once per level, and a deep enough file ended in a RecursionError traceback.
MAX_CONFIG_BYTES = 256 << 10
MAX_CONFIG_DEPTH = 20


class TooDeep(Exception):
    pass


class BoundedLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that stops composing past MAX_CONFIG_DEPTH levels of nesting."""

    depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self.depth += 1
        try:
            if self.depth > MAX_CONFIG_DEPTH + 1:  # + 1: the value at the bottom is a node too
                raise TooDeep
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


def read_config_file(path: Path) -> Any:
    """The YAML document of a config file, refused in one line when too large, too deep or invalid."""
    try:
        with open(path, "rb") as handle:
            text = handle.read(MAX_CONFIG_BYTES + 1)
    except OSError as error:
        raise ConfigError(f"cannot read config file '{path}': {error.strerror}") from None
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file '{path}' is larger than {MAX_CONFIG_BYTES >> 10} KB: a config holds a few KB "
                          "of keys (is it the right file?)")
    try:
        return yaml.load(text, Loader=BoundedLoader)  # a SafeLoader: no Python objects
    except TooDeep:
        raise ConfigError(f"config file '{path}' nests more than {MAX_CONFIG_DEPTH} levels deep: a config has "
                          "sections of keys (e.g. train: {epochs: 90}), at most 3 levels") from None
    except (yaml.YAMLError, ValueError) as error:  # ValueError: e.g. an integer of more than 4300 digits
        first = str(error).splitlines()[0].split("; use sys.")[0]
        raise ConfigError(f"config file '{path}' is not valid YAML: {first}") from None
