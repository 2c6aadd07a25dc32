"""Dotted keys on nested dataclasses: typed values, and the nearest valid key for a mistyped one.

The machinery under config.py: ``set_key(cfg, "train.epochs", "3", from_text=True)`` coerces the
text to the field's type or raises a one-line ``ConfigError`` naming the key and what is valid.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import reprlib
import typing
from typing import Any, Literal


class ConfigError(ValueError):
    """A configuration problem, phrased as one line for the user."""


def field_types(cls: type) -> dict[str, Any]:
    return dict(_field_types(cls))


@functools.lru_cache(maxsize=None)
def _field_types(cls: type) -> dict[str, Any]:
    # typing.get_type_hints evaluates every annotation of the class each time: building one config
    # called it 342 times, 0.3-0.9 s of a run's start-up on 2 cores. A class's hints do not change.
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(str(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


# Values quoted in messages are shortened: a YAML file can hand a key a megabyte string, or a list
# nested (through anchors) deeper than repr's recursion allows.
SHORT = reprlib.Repr()
SHORT.maxstring = SHORT.maxother = 80
SHORT.maxlevel = 3
# Longer unknown keys get no "did you mean": no key is near one (the longest is about 40 characters).
MAX_SUGGESTED_LENGTH = 100


def coerce(key: str, value: Any, tp: Any, from_text: bool) -> Any:
    """Turn ``value`` into ``tp`` or raise a one-line ConfigError naming ``key``."""

    def bad() -> ConfigError:
        return ConfigError(f"config key '{key}' expects {type_name(tp)}, got {SHORT.repr(value)}")

    if typing.get_origin(tp) is Literal:
        choices = typing.get_args(tp)
        text = str(value) if from_text or isinstance(value, str) else value
        if text not in choices:
            raise bad()
        return text
    if tp is bool:
        if isinstance(value, bool):
            return value
        if from_text and str(value).lower() in ("true", "false", "yes", "no", "1", "0", "on", "off"):
            return str(value).lower() in ("true", "yes", "1", "on")
        raise bad()
    if tp in (int, float):
        # An int field takes ints only (3.0 is refused); a float field takes ints too. Text is
        # parsed, which also covers YAML 1.1 reading "1e-4" as a string.
        exact = (int,) if tp is int else (int, float)
        if isinstance(value, bool):
            raise bad()
        if isinstance(value, exact):
            number = tp(value)
        elif isinstance(value, str):
            try:
                number = tp(value)
            except ValueError:  # also an int of more than 4300 digits
                raise bad() from None
        else:
            raise bad()
        # YAML's .nan/.inf and the text "nan", "inf", "-inf" parse as floats; no key means them (a
        # nan learning rate trains to a nan loss and exits 0), and a comparison with nan is always
        # false, so the range checks of validate() would let it through.
        if tp is float and not math.isfinite(number):
            raise ConfigError(f"config key '{key}' must be a finite number, got {SHORT.repr(value)}")
        return number
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        if value is None:
            return ""
        raise bad()
    raise TypeError(f"unsupported config field type {tp!r} for {key}")


def set_key(cfg: Any, dotted: str, value: Any, from_text: bool, wait: bool = True) -> None:
    """Set ``dotted`` on ``cfg``. A top-level section that ``cfg`` does not have waits in
    ``cfg.waiting`` (where ``cfg`` keeps such a list, and ``wait``): it may be the section of a task
    not named yet (config/root.py). A key that moved (``cfg.MOVED_KEYS``) stops naming its new place."""
    parts = dotted.split(".")
    node = cfg
    for depth, name in enumerate(parts):
        types = field_types(type(node))
        prefix = ".".join(parts[:depth])
        if name not in types:
            moved = getattr(cfg, "MOVED_KEYS", {}).get(dotted)
            if moved:
                raise ConfigError(f"config key '{dotted}' is now '{moved}' (the task's own section): rename it")
            if depth == 0 and wait and name.isidentifier() and isinstance(getattr(cfg, "waiting", None), list):
                cfg.waiting.append((dotted, value, from_text))
                return
            where = f" in '{prefix}'" if prefix else ""
            raise ConfigError(f"unknown config key {SHORT.repr(dotted)} (valid keys{where}: {', '.join(sorted(types))})"
                              + did_you_mean(type(cfg), dotted))
        tp = types[name]
        last = depth == len(parts) - 1
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            if last:
                if not isinstance(value, dict):
                    keys = ", ".join(sorted(field_types(tp)))
                    raise ConfigError(f"config key '{dotted}' is a section; set its keys ({keys})")
                for sub_key, sub_value in value.items():
                    set_key(cfg, f"{dotted}.{sub_key}", sub_value, from_text, wait)
                return
            node = getattr(node, name)
        else:
            if not last:
                raise ConfigError(f"config key '{'.'.join(parts[:depth + 1])}' is a value, not a section")
            setattr(node, name, coerce(dotted, value, tp, from_text))


def all_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key, sections included ('train' and 'train.epochs'), in declaration order."""
    keys = []
    for name, tp in field_types(cls).items():
        keys.append(prefix + name)
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            keys += all_keys(tp, f"{prefix}{name}.")
    return keys


def suggest_keys(root: type, dotted: str, limit: int = 2) -> list[str]:
    """The valid keys nearest to a mistyped one, best first; empty when none is near.

    A right key in the wrong section or without its section ('train.base_lr', 'batch_size') is
    found by its last part. Otherwise the whole dotted key is compared with the keys of as many
    parts, so that a typo in the section ('trian.epochs') is found as well as one in the key
    ('train.epoch'). Only matches about as close as the best are kept: a list of far guesses
    would hide the one that helps.
    """
    if len(dotted) > MAX_SUGGESTED_LENGTH:
        return []  # difflib is quadratic: a 500 KB key from a YAML file took 26 s to compare
    keys = [key for key in all_keys(root) if key != dotted]
    leaf = dotted.rsplit(".", 1)[-1]
    same_leaf = [key for key in keys if key.rsplit(".", 1)[-1] == leaf]
    same_depth = [key for key in keys if key.count(".") == dotted.count(".")]
    scored = sorted(((difflib.SequenceMatcher(None, dotted, key).ratio(), key) for key in same_depth),
                    reverse=True)
    best = scored[0][0] if scored else 0.0
    close = [key for score, key in scored if score >= 0.7 and score >= best - 0.1]
    return list(dict.fromkeys(same_leaf + close))[:limit]


def did_you_mean(root: type, dotted: str) -> str:
    """'; did you mean 'a'?' for an unknown key, or nothing when no valid key is near."""
    found = suggest_keys(root, dotted)
    return f"; did you mean {' or '.join(repr(key) for key in found)}?" if found else ""
