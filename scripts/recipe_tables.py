"""Rewrite the preset tables of docs/recipes.md from hvdtrain/configs/published.json: python scripts/recipe_tables.py

The published values of the ImageNet presets (``hvdtrain/configs/published.json``) and how a preset
resolves them. tests/unit/test_presets.py loads this file by path (as test_readme.py loads
config_table.py) and fails when a preset drifts from a row, or when a table here is stale.

Each preset row names a setting, the hvdtrain key or derived quantity that expresses it, the source's
value in its own words, the value hvdtrain must resolve to, and where the source writes it
(repository@commit path:line, or a paper's section). A row without a key is a difference hvdtrain
cannot express; the preset's YAML header lists it. ``tests/unit/test_presets.py`` resolves every row
of every preset, so an edit of a preset that drifts from its source fails there, and
``scripts/recipe_tables.py`` writes the tables of docs/recipes.md from the same rows.

Derived quantities: ``ranks`` (the source's GPU count, which the preset assumes), ``global_batch``
(per-rank batch x ranks x backward passes), ``lr.peak`` (the scaled rate), ``lr.warmup_start`` (the
rate of the warm-up's first step), ``lr.epoch.E`` (the rate
in effect at epoch E on ImageNet's 1281167 images at the preset's global batch), ``val.resize`` and
``val.crop`` (the validation resize and crop), ``decay.decayed_1d_count`` (1-d tensors of the
preset's model that get weight decay), ``lars.epsilon`` and ``lars.adapt`` (fixed in hvdtrain's LARS).
"""

from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path
from typing import Any

from hvdtrain.config import PACKAGED_CONFIGS, Config
from hvdtrain.job_config import load_config

PUBLISHED = PACKAGED_CONFIGS / "published.json"
IMAGENET_TRAIN = 1281167


def load_published(path: Path = PUBLISHED) -> dict[str, Any]:
    """The presets' published rows: {preset name: {source, published, ranks, rows}}."""
    return json.loads(path.read_text())["presets"]


@lru_cache(maxsize=16)
def decayed_vectors(arch: str, rule: str, names: str, blurpool: bool) -> int:
    """1-d tensors of ``arch`` (as the preset builds it) that get weight decay under ``rule``."""
    from hvdtrain.config import ModelConfig
    from hvdtrain.model.build import build_model
    from hvdtrain.optim.build import decay_exempt

    model = build_model(ModelConfig(arch=arch, blurpool=blurpool), 1000)
    exempt = decay_exempt(model, rule, names)
    return sum(1 for name, param in model.named_parameters() if param.ndim <= 1 and name not in exempt)


def resolve(cfg: Config, key: str, ranks: int) -> Any:
    """The value a preset resolves ``key`` to, on ``ranks`` ranks (see the module docstring)."""
    from hvdtrain.data.image.transforms import val_image_size, val_resize_size
    from hvdtrain.optim.build import LRSchedule, lr_at

    passes = cfg.train.backward_passes_per_step
    # A global batch said once (train.global_batch_size, main.py's -b) fixes the per-rank batch.
    per_rank = cfg.train.global_batch_size // (ranks * passes) if cfg.train.global_batch_size else cfg.train.batch_size
    global_batch = per_rank * ranks * passes
    if key == "ranks":
        return ranks
    if key == "global_batch":
        return global_batch
    if key == "train.batch_size":
        return per_rank
    steps = max(1, IMAGENET_TRAIN // global_batch)
    # optim.lr is a rate as it is; else the per-256 rate (or optim.lr_per_rank, one rank's) scaled linearly
    schedule = LRSchedule.from_config(cfg.optim, global_batch, cfg.train.epochs, steps, per_rank, passes)
    if key == "lr.peak":
        return schedule.peak_lr
    if key == "lr.warmup_start":
        return schedule.start_lr
    if key.startswith("lr.epoch."):
        return lr_at(int(round(float(key[len("lr.epoch."):]) * steps)), schedule)
    if key == "val.resize":
        return val_resize_size(cfg.data)
    if key == "val.crop":
        return val_image_size(cfg.data)
    if key == "decay.decayed_1d_count":
        return decayed_vectors(cfg.model.arch, cfg.optim.no_decay, cfg.optim.no_decay_names, cfg.model.blurpool)
    if key == "lars.epsilon":
        return 0.0  # hvdtrain's LARS has no epsilon in its trust ratio
    if key == "lars.adapt":
        return "ndim"  # LARS and LAMB adapt matrices and convolutions only (optim.build_optimizer)
    value: Any = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def matches(value: Any, expected: Any) -> bool:
    if isinstance(expected, float) and not isinstance(value, bool):
        return math.isclose(float(value), expected, rel_tol=1e-9, abs_tol=1e-12)
    return value == expected


def shown(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def table(name: str, entry: dict[str, Any]) -> str:
    """The markdown table of one preset: setting, preset value, published value, source, match."""
    cfg = load_config(name)
    lines = ["| setting | preset | published | source | match |", "| --- | --- | --- | --- | --- |"]
    for row in entry["rows"]:
        if row["key"] is None:
            preset, match = row["preset"], "no (in the header)"
        else:
            value = resolve(cfg, row["key"], entry["ranks"])
            preset = f"`{row['key']}` = {shown(value)}"
            match = "yes" if matches(value, row["expected"]) else "**no**"
        cells = [row["name"], preset, row["published"], row["cite"], match]
        lines.append("| " + " | ".join(str(cell).replace("|", "/") for cell in cells) + " |")
    return "\n".join(lines)


RECIPES_DOC = Path(__file__).resolve().parents[1] / "docs" / "recipes.md"


def markers(name: str) -> tuple[str, str]:
    return f"<!-- preset-table:{name}:start -->", f"<!-- preset-table:{name}:end -->"


def current_table(text: str, name: str) -> str:
    """The table between a preset's markers in ``text`` (empty when the markers are missing)."""
    start, end = markers(name)
    if start not in text:
        return ""
    return text.split(start, 1)[1].split(end, 1)[0].strip()


def with_tables(text: str, published: dict[str, Any]) -> str:
    """``text`` with every preset's table (between its markers) replaced by table()."""
    for name, entry in published.items():
        start, end = markers(name)
        head, rest = text.split(start, 1)
        _, tail = rest.split(end, 1)
        text = f"{head}{start}\n{table(name, entry)}\n{end}{tail}"
    return text


if __name__ == "__main__":
    RECIPES_DOC.write_text(with_tables(RECIPES_DOC.read_text(), load_published()))
    print(f"wrote the preset tables of {RECIPES_DOC}")
