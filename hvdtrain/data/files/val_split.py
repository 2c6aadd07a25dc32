"""``data.val_fraction``: a validation set carved out of ``train/`` for datasets without ``val/``.

The split is per class (every class keeps its proportion: a stratified split) and deterministic:
within a class, files are ordered by a hash of (seed, path) and the first ``fraction`` of them are
held out. It depends on nothing but the file names, the fraction and the seed, never on the
number of ranks or the order of the directory listing.

Rank 0 writes the chosen files to ``<output.dir>/val_split.json`` on the first start and reads
them back on every later one (a resumed run, ``hvdtrain evaluate``), so a run validates on the
same images from start to end even if the seed, the code or the folder changes; every other rank
receives rank 0's split by broadcast. It is written only into a run folder that training made and
checked (hvdtrain/ownership.py): evaluation makes no folder where a checkpoint's config points.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable

from ...ownership import PRIVATE, folder_problem, write_atomic
from .index import DataError, FileIndex, SplitIndex, compact

FORMAT = "hvdtrain-val-split-v1"
FILE_NAME = "val_split.json"


def choose(train: SplitIndex, fraction: float, seed: int) -> list[str]:
    """The held-out paths: round(fraction x n) files of each class of n (at least one where n >= 2)."""
    by_class: dict[int, list[str]] = {}
    for path, label in zip(train.paths, train.labels):
        by_class.setdefault(label, []).append(path)
    held_out = []
    for label in sorted(by_class):
        paths = sorted(by_class[label], key=lambda p: hashlib.sha256(f"{seed}:{p}".encode()).hexdigest())
        count = min(len(paths) - 1, max(1, round(fraction * len(paths))))
        held_out += sorted(paths[:count])
    return held_out


def apply_split(index: FileIndex, val_paths: list[str]) -> FileIndex:
    """``index`` with ``val_paths`` moved from its train split into its val split (paths stay
    relative to train/), as compact arrays in memory (one copy per rank: no cache file holds it)."""
    held = set(val_paths)
    label_of = dict(zip(index.train.paths, index.train.labels))
    missing = [p for p in val_paths if p not in label_of]
    if missing:
        raise DataError(f"{len(missing)} validation files of the recorded split are no longer in train/ "
                        f"(e.g. {missing[0]}); delete {FILE_NAME} in the run directory to split again")
    kept = [(p, label) for p, label in zip(index.train.paths, index.train.labels) if p not in held]
    train = SplitIndex(index.train.classes, [p for p, _ in kept], [label for _, label in kept])
    val = SplitIndex(index.train.classes, list(val_paths), [label_of[p] for p in val_paths])
    return compact(FileIndex(index.root, train, val, index.source, index.seconds))


def load_or_choose(index: FileIndex, fraction: float, seed: int, run_dir: Path,
                   share: str = PRIVATE) -> tuple[list[str], str]:
    """The recorded split of ``run_dir``, or a new one written there; and a line saying which."""
    path = run_dir / FILE_NAME
    if path.is_file():
        try:
            payload = json.loads(path.read_text(encoding="utf-8"))
            assert payload["format"] == FORMAT and isinstance(payload["val"], list)
        except (ValueError, KeyError, TypeError, AssertionError):
            raise DataError(f"{path} is not a validation split written by hvdtrain; delete it to split again") \
                from None
        if abs(float(payload["fraction"]) - fraction) > 1e-12:
            raise DataError(f"data.val_fraction={fraction:g}, but this run's split {path} holds "
                            f"{payload['fraction']:g}: set data.val_fraction={payload['fraction']:g}, or delete "
                            f"the file (and the run's checkpoints) to split again")
        return payload["val"], f"validation split: {len(payload['val'])} files of train/ as recorded in {path}"
    val = choose(index.train, fraction, seed)
    chosen = (f"validation split: {len(val)} of {len(index.train)} files of train/ (data.val_fraction={fraction:g}, "
              f"seed {seed})")
    if not run_dir.is_dir() or folder_problem(run_dir, share) is not None:
        # Evaluation (setup made no folder: output.dir is what a checkpoint recorded) or a folder that
        # is not the user's: nothing is made or written there.
        return val, f"{chosen}, not recorded (no run folder of yours at {run_dir})"
    write_atomic(path, json.dumps({"format": FORMAT, "fraction": fraction, "seed": seed, "val": val}, indent=0),
                 share)  # never through a planted link
    return val, f"{chosen}, recorded in {path}"


def shared_split(index: FileIndex, fraction: float, seed: int, run_dir: Path, is_primary: bool,
                 broadcast_object: Callable[[Any], Any] | None = None, share: str = PRIVATE) -> tuple[FileIndex, str]:
    """Rank 0 loads or chooses the split; every rank gets it (or the same one-line error)."""
    result: tuple[str, Any] = ("error", "not built")
    if is_primary or broadcast_object is None:
        try:
            result = ("ok", load_or_choose(index, fraction, seed, run_dir, share))
        except DataError as error:
            result = ("error", str(error))
    if broadcast_object is not None:
        result = broadcast_object(result)
    status, value = result
    if status != "ok":
        raise DataError(value)
    val_paths, note = value
    return apply_split(index, val_paths), note
