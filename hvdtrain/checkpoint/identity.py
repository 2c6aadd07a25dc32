"""Whether a checkpoint belongs to this run: its stored config against the config the run was
started with, before anything is loaded or written.

A resume that silently continues another run is worse than an error: a changed learning rate
makes the record of the run wrong, another model ends in tracebacks from every rank. The keys that
decide what a run computes (the task, the model, the data and its augmentation, the optimizer and
its schedule, the seed, the per-rank batch, the precision) must be the checkpoint's; a difference
stops the job with one line that names each key with both values and the two ways out. The keys
that may change between two legs of one run (more epochs, other workers or threads, logging,
checkpoint cadence, the data's location, trackers) resume, and the change is said in one line.
``checkpoint.resume=force`` resumes through any difference and records it in metrics.jsonl.

The number of ranks may change (the global batch and the learning rate follow it: train/run.py's
resume), so it is not compared.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..config import Config, flatten, migrate_moved_keys, to_dict

# A key's value in the checkpoint's config, and now.
Change = tuple[Any, Any]

# Keys (or whole sections, with a trailing dot) that may change between the legs of one run.
MAY_CHANGE = ("train.epochs", "train.target", "train.target_metric", "train.target_top1",
              "data.dir", "data.workers", "data.prefetch_factor", "data.mp_context", "data.index_cache",
              "data.on_bad_file", "data.max_bad_fraction", "data.decoder", "data.max_image_pixels",
              "recommendation.on_bad_line", "recommendation.ratings_cache",
              "runtime.", "output.", "checkpoint.", "tracking.", "eval.", "elastic.commit_every_steps",
              "elastic.sample_log", "dist.timeout_seconds", "dist.straggler_threshold", "dist.stall_warning_seconds",
              "dist.stall_shutdown_seconds", "dist.bucket_mb", "dist.compression", "dist.engine",
              "amp.max_skipped_steps")
SHOWN = 4  # differences named in the line; the rest are counted


def may_change(key: str) -> bool:
    return any(key == item or (item.endswith(".") and key.startswith(item)) for item in MAY_CHANGE)


def differences(stored: dict[str, Any], cfg: Config) -> tuple[dict[str, Change], dict[str, Change]]:
    """(keys that change what the run computes, keys that may change): key -> (checkpoint's, now).
    A key the checkpoint's config lacks (written by an older hvdtrain) counts as its default, and a key
    that moved since into the task's section is compared at its new place."""
    defaults = flatten(dataclasses.asdict(type(cfg)()))
    before = {**defaults, **flatten(migrate_moved_keys(stored))}
    now = flatten(to_dict(cfg))
    meaning: dict[str, Change] = {}
    allowed: dict[str, Change] = {}
    for key, value in now.items():
        if key in before and before[key] != value:
            (allowed if may_change(key) else meaning)[key] = (before[key], value)
    # A global batch said once (train.global_batch_size) is the run's batch: the per-rank batch that
    # follows from it changes with the number of ranks, as the number of ranks may.
    if now.get("train.global_batch_size") and before.get("train.global_batch_size") == now["train.global_batch_size"]:
        meaning.pop("train.batch_size", None)
    return meaning, allowed


def listed(changes: dict[str, Change]) -> str:
    shown = [f"{key}={old!r} (now {new!r})" for key, (old, new) in list(changes.items())[:SHOWN]]
    more = len(changes) - SHOWN
    return ", ".join(shown) + (f" and {more} more" if more > 0 else "")


def refusal(source: str, changes: dict[str, Change]) -> str:
    return (f"checkpoint.resume: {source} belongs to another run: it was trained with {listed(changes)}; "
            f"start this run in another output.dir, or set checkpoint.resume=force to continue that run with "
            f"the new values (recorded in metrics.jsonl)")


def unwrapped(key: str) -> str:
    """A state-dict key without wrapper prefixes, as checkpoints store them (model.unwrap_state_dict)."""
    for prefix in ("module.", "_orig_mod."):
        while key.startswith(prefix):
            key = key[len(prefix):]
    return key


def model_fit(stored: dict[str, torch.Tensor], model: torch.nn.Module, source: str) -> str | None:
    """One line naming the tensors a checkpoint's model lacks, has too many of, or has in another
    shape than ``model``; None when it fits."""
    current = {unwrapped(key): value for key, value in model.state_dict().items()}
    missing = [key for key in current if key not in stored]
    unexpected = [key for key in stored if key not in current]
    shapes = [f"{key} {tuple(stored[key].shape)} vs {tuple(current[key].shape)}" for key in current
              if key in stored and hasattr(stored[key], "shape") and stored[key].shape != current[key].shape]
    if not (missing or unexpected or shapes):
        return None
    parts = ([f"{len(shapes)} tensor(s) of another shape (checkpoint vs model), e.g. {', '.join(shapes[:2])}"]
             if shapes else [])
    parts += [f"{len(missing)} missing, e.g. {', '.join(missing[:2])}"] if missing else []
    parts += [f"{len(unexpected)} unknown to this model, e.g. {', '.join(unexpected[:2])}"] if unexpected else []
    return f"checkpoint {source} does not fit this model: {'; '.join(parts)}; is it another architecture's?"
