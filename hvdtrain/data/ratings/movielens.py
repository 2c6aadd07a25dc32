"""MovieLens ratings: the three real file formats, id remapping, the train/validation split, a
cache under the user's own cache folder, and the built-in generated dataset.

Formats, detected from the folder's contents (the first of these names found):

* ``ratings.csv`` (ml-latest, ml-latest-small, ml-20m, ml-25m): ``userId,movieId,rating,timestamp``
  with that header line;
* ``u.data`` (ml-100k): ``user<TAB>item<TAB>rating<TAB>timestamp``;
* ``ratings.dat`` (ml-1m, ml-10m): ``UserID::MovieID::Rating::Timestamp``.

Raw user and movie ids become dense indexes 0..n-1 in increasing order of the raw id, so the
same file always gives the same mapping (checkpoints keep it and a resumed run checks it).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from stat import S_ISREG, S_IWGRP, S_IWOTH
from typing import Callable

import numpy as np

from ...ownership import UnsafePath, own_folder
from ..files.index import DataError, sha256_file

FORMATS = {"ratings.csv": ",", "u.data": "\t", "ratings.dat": "::"}
CSV_HEADER = "userId,movieId,rating,timestamp"
MIN_RATING, MAX_RATING = 0.5, 5.0
CACHE_VERSION = "movielens-v1"
GENERATED_VERSION = "latent-v3"


@dataclass
class Ratings:
    """Ratings with dense indexes; ``user_ids[u]`` / ``item_ids[i]`` are the raw ids of index u / i."""

    users: np.ndarray        # int64 dense user index per rating
    items: np.ndarray        # int64 dense item index per rating
    ratings: np.ndarray      # float32
    timestamps: np.ndarray   # int64
    user_ids: np.ndarray     # int64 raw ids, increasing
    item_ids: np.ndarray
    skipped: int = 0         # malformed lines skipped (recommendation.on_bad_line=skip)

    @property
    def num_users(self) -> int:
        return len(self.user_ids)

    @property
    def num_items(self) -> int:
        return len(self.item_ids)

    def __len__(self) -> int:
        return len(self.users)


@dataclass
class Split:
    """Ratings and which of them are for validation, with where they came from."""

    ratings: Ratings
    val: np.ndarray                     # bool mask over the ratings
    source: Path
    fmt: str
    from_cache: bool = False
    seconds: float = 0.0
    cache_path: Path | None = None
    train_index: np.ndarray = field(init=False)
    val_index: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.train_index = np.flatnonzero(~self.val)
        self.val_index = np.flatnonzero(self.val)


# --- finding and parsing the file ----------------------------------------------------------------

def find_ratings_file(folder: Path) -> tuple[Path, str]:
    """The ratings file of a MovieLens folder and its format name (a file name in FORMATS)."""
    if folder.is_file() and folder.name in FORMATS:
        return folder, folder.name
    if not folder.is_dir():
        raise DataError(f"data.dir '{folder}' does not exist (give a MovieLens folder with ratings.csv, "
                        f"u.data or ratings.dat, or leave data.dir empty for the built-in data)")
    for name in FORMATS:
        if (folder / name).is_file():
            return folder / name, name
    raise DataError(f"'{folder}' holds no MovieLens ratings file in any known format (expected ratings.csv of "
                    f"ml-latest, u.data of ml-100k or ratings.dat of ml-1m/ml-10m)")


def parse_ratings(path: Path, fmt: str, on_bad_line: str = "fail",
                  warn: Callable[[str], None] | None = None) -> Ratings:
    """Read a ratings file of format ``fmt``; a malformed line stops with the file and line number,
    or with ``on_bad_line='skip'`` is counted and skipped (the first few are reported to ``warn``)."""
    separator = FORMATS[fmt]
    users: list[int] = []
    items: list[int] = []
    values: list[float] = []
    stamps: list[int] = []
    skipped = 0
    with open(path, encoding="utf-8", errors="replace") as handle:
        first = True
        for number, line in enumerate(handle, start=1):
            line = line.rstrip("\r\n")
            if first:
                first = False
                if fmt == "ratings.csv":
                    if line.strip().lstrip("\ufeff") != CSV_HEADER:
                        raise DataError(f"{path}, line 1: not a MovieLens ratings.csv (expected the header "
                                        f"'{CSV_HEADER}', got '{line[:60]}')")
                    continue
                if separator not in line:
                    raise DataError(f"{path}, line 1: not in the {fmt} format (fields separated by "
                                    f"{separator!r}: user, item, rating, timestamp), got '{line[:60]}'")
            if not line.strip():
                continue
            problem = None
            fields = line.split(separator)
            if len(fields) != 4:
                problem = f"expected 4 fields separated by {separator!r}, got {len(fields)}"
            else:
                user, item, rating, stamp = (f.strip() for f in fields)
                if not user.isdigit():
                    problem = f"user id '{user[:20]}' is not an integer"
                elif not item.isdigit():
                    problem = f"item id '{item[:20]}' is not an integer"
                else:
                    try:
                        value = float(rating)
                    except ValueError:
                        value = None
                    if value is None or value != value:  # not a number at all (or "nan")
                        problem = f"rating '{rating[:20]}' is not a number"
                    elif not MIN_RATING <= value <= MAX_RATING:
                        problem = f"rating '{rating[:20]}' is outside the scale {MIN_RATING:g}-{MAX_RATING:g}"
                    elif not stamp.lstrip("-").isdigit():
                        problem = f"timestamp '{stamp[:20]}' is not an integer"
            if problem is not None:
                if on_bad_line != "skip":
                    raise DataError(f"{path}, line {number}: {problem} (fix the file, or set "
                                    f"recommendation.on_bad_line=skip to skip such lines)")
                skipped += 1
                if warn is not None and skipped <= 3:
                    warn(f"hvdtrain: skipping {path}, line {number}: {problem}")
                continue
            users.append(int(user))
            items.append(int(item))
            values.append(value)
            stamps.append(int(stamp))
    if not users:
        what = "is empty" if skipped == 0 else f"has no valid rating ({skipped} bad lines skipped)"
        raise DataError(f"{path} {what}: no ratings to train on")
    return remap(np.array(users, dtype=np.int64), np.array(items, dtype=np.int64),
                 np.array(values, dtype=np.float32), np.array(stamps, dtype=np.int64), skipped)


def remap(raw_users: np.ndarray, raw_items: np.ndarray, ratings: np.ndarray, timestamps: np.ndarray,
          skipped: int = 0) -> Ratings:
    """Dense indexes in increasing order of the raw ids."""
    user_ids, users = np.unique(raw_users, return_inverse=True)
    item_ids, items = np.unique(raw_items, return_inverse=True)
    return Ratings(users.astype(np.int64), items.astype(np.int64), ratings, timestamps, user_ids, item_ids, skipped)


# --- the split -----------------------------------------------------------------------------------

def split_mask(ratings: Ratings, method: str, fraction: float, seed: int) -> np.ndarray:
    """Which ratings go to validation.

    ``leave_last_out``: each user's latest rating (by timestamp; among equal timestamps the last in
    the file), the protocol of He et al. 2017; a user with a single rating keeps it for training.
    ``random``: a seeded ``fraction`` of all ratings.
    """
    n = len(ratings)
    mask = np.zeros(n, dtype=bool)
    if method == "random":
        count = int(round(n * fraction))
        order = np.random.default_rng(seed).permutation(n)
        mask[order[:count]] = True
        return mask
    if method != "leave_last_out":
        raise ValueError(method)
    # Sort by (user, timestamp, position): the last row of each user's run is its latest rating.
    order = np.lexsort((np.arange(n), ratings.timestamps, ratings.users))
    users_sorted = ratings.users[order]
    last = np.ones(n, dtype=bool)
    last[:-1] = users_sorted[1:] != users_sorted[:-1]
    counts = np.bincount(ratings.users, minlength=ratings.num_users)
    last &= counts[users_sorted] > 1
    mask[order[last]] = True
    return mask


# --- the cache -----------------------------------------------------------------------------------

def source_signature(path: Path) -> str:
    """The source's content hash: a cache is used only for the exact bytes it was built from
    (size and modification time can stay the same through an edit, a copy with ``cp -p`` or
    ``rsync -t``). Hashing reads the file once, at disk speed; parsing is far slower."""
    return f"sha256:{sha256_file(path)}"


def cache_key(path: Path, method: str, fraction: float, seed: int, on_bad_line: str) -> str:
    text = f"{CACHE_VERSION}|{path.resolve()}|{method}|{fraction if method == 'random' else ''}|" \
           f"{seed if method == 'random' else ''}|{on_bad_line}"
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def cache_candidates(path: Path, key: str, cache_dir: Path | None) -> list[Path]:
    """Where the cache of ``path`` lives: under the user's own cache folder (``cache_dir``, default
    ``$HVDTRAIN_CACHE`` or ``~/.cache/hvdtrain``), never next to the source, whose folder others
    may be able to write."""
    if cache_dir is None:
        from ..demo import cache_root

        cache_dir = cache_root()
    return [cache_dir / "movielens" / f"{path.name}.hvdtrain-{key}.npz"]


def trusted(handle: int) -> bool:
    """A cache file this user owns, that nobody else can write, and that is a regular file."""
    stat = os.fstat(handle)
    return (S_ISREG(stat.st_mode) and stat.st_uid == os.getuid()
            and not stat.st_mode & (S_IWGRP | S_IWOTH))


def read_cache(candidates: list[Path], signature: str) -> tuple[Ratings, np.ndarray, Path] | None:
    for candidate in candidates:
        try:
            handle = os.open(candidate, os.O_RDONLY | os.O_NOFOLLOW)  # a link planted at the name is refused
        except OSError:
            continue
        with os.fdopen(handle, "rb") as stream:
            try:
                if not trusted(handle):
                    continue  # another user's file, or one others can write: parse again, and replace it
                with np.load(stream, allow_pickle=False) as saved:
                    if str(saved["signature"]) != signature:
                        continue  # the source changed since: parse again
                    ratings = Ratings(saved["users"], saved["items"], saved["ratings"], saved["timestamps"],
                                      saved["user_ids"], saved["item_ids"], int(saved["skipped"]))
                    return ratings, saved["val"], candidate
            except (OSError, KeyError, ValueError, EOFError):
                continue
    return None


def write_cache(candidates: list[Path], signature: str, ratings: Ratings, val: np.ndarray) -> Path | None:
    """Write atomically (a new temporary file, then a rename), so racing processes are safe. The
    temporary file is created with O_EXCL (mkstemp, mode 0600): a file or link someone planted at
    a name we would pick is never written through."""
    for candidate in candidates:
        scratch = None
        try:
            own_folder(candidate.parent)  # the user's own, 0700 (the folders it makes too); else UnsafePath
            handle, scratch = tempfile.mkstemp(prefix=f".{candidate.name}.", suffix=".tmp", dir=candidate.parent)
            with os.fdopen(handle, "wb") as stream:
                np.savez(stream, signature=np.array(signature), users=ratings.users, items=ratings.items,
                         ratings=ratings.ratings, timestamps=ratings.timestamps, user_ids=ratings.user_ids,
                         item_ids=ratings.item_ids, skipped=np.array(ratings.skipped), val=val)
            os.replace(scratch, candidate)
            return candidate
        except (OSError, UnsafePath):  # not written: parsed again next time
            if scratch is not None:
                try:
                    os.unlink(scratch)
                except OSError:
                    pass
    return None


def load_split(folder: Path, method: str, fraction: float, seed: int, on_bad_line: str = "fail",
               cache: bool = True, fallback_cache: Path | None = None,
               warn: Callable[[str], None] | None = None) -> Split:
    """The parsed and split ratings of a MovieLens folder, from the cache when it is current.
    ``fallback_cache``: the user's cache folder the cache goes under (default ``cache_root()``)."""
    start = time.perf_counter()
    path, fmt = find_ratings_file(folder)
    candidates = cache_candidates(path, cache_key(path, method, fraction, seed, on_bad_line), fallback_cache)
    signature = source_signature(path) if cache else ""
    if cache:
        found = read_cache(candidates, signature)
        if found is not None:
            ratings, val, where = found
            return Split(ratings, val, path, fmt, True, time.perf_counter() - start, where)
    ratings = parse_ratings(path, fmt, on_bad_line, warn)
    val = split_mask(ratings, method, fraction, seed)
    where = write_cache(candidates, signature, ratings, val) if cache else None
    return Split(ratings, val, path, fmt, False, time.perf_counter() - start, where)


# --- the built-in dataset ------------------------------------------------------------------------

def generate_ratings(num_users: int = 610, num_items: int = 9000, num_ratings: int = 100_000, dim: int = 8,
                     seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Ratings from a latent-factor model, shaped like ml-latest-small.

    Item popularity is long-tailed (Zipf-like), each user's number of ratings too (at least 20, as
    in MovieLens). Which items a user rates depends on popularity and on the user's taste (the same
    factors as the ratings), so that a recommender can beat popularity; the rating is
    ``mean + user bias + item bias + taste . item factors + noise``, rounded to the half-star scale.
    Returns raw (1-based) user ids, movie ids, ratings and timestamps.
    """
    rng = np.random.default_rng(seed)
    user_factors = rng.normal(0, 1, (num_users, dim)) / np.sqrt(dim)
    item_factors = rng.normal(0, 1, (num_items, dim))
    user_bias = rng.normal(0, 0.45, num_users)
    item_bias = rng.normal(0, 0.4, num_items)
    popularity = 1.0 / np.arange(1, num_items + 1) ** 0.9
    rng.shuffle(popularity)
    log_popularity = np.log(popularity)
    activity = rng.lognormal(0, 1.0, num_users)
    counts = 20 + np.round(activity / activity.sum() * (num_ratings - 20 * num_users))
    counts = np.minimum(counts, num_items // 2).astype(int)
    counts[np.argmax(counts)] += num_ratings - counts.sum()  # exactly num_ratings (the heaviest user absorbs it)
    users, items, values, stamps = [], [], [], []
    for user in range(num_users):
        affinity = item_factors @ user_factors[user]
        logits = log_popularity + 2.0 * affinity
        weights = np.exp(logits - logits.max())
        chosen = rng.choice(num_items, size=counts[user], replace=False, p=weights / weights.sum())
        # Taste relative to the user's own choices (the user bias holds the user's level).
        taste = affinity[chosen] - affinity[chosen].mean()
        score = 3.5 + user_bias[user] + item_bias[chosen] + taste + rng.normal(0, 0.5, len(chosen))
        start = rng.integers(946_684_800, 1_500_000_000)
        users.append(np.full(len(chosen), user + 1))
        items.append(chosen + 1)
        values.append(np.clip(np.round(score * 2) / 2, MIN_RATING, MAX_RATING))
        stamps.append(start + rng.integers(0, 86_400 * 365, len(chosen)))
    return (np.concatenate(users), np.concatenate(items), np.concatenate(values).astype(np.float32),
            np.concatenate(stamps))


def write_ratings_csv(path: Path, users: np.ndarray, items: np.ndarray, ratings: np.ndarray,
                      timestamps: np.ndarray) -> None:
    lines = [CSV_HEADER] + [f"{u},{i},{r:g},{t}" for u, i, r, t in zip(users.tolist(), items.tolist(),
                                                                        ratings.tolist(), timestamps.tolist())]
    path.write_text("\n".join(lines) + "\n")


def ensure_generated_dataset(root: Path, **sizes: int) -> Path:
    """The built-in dataset's folder (``ratings.csv``), generated once; safe when processes race."""
    own_folder(root.parent, what="dataset cache folder", fix="set HVDTRAIN_CACHE to a folder of yours")
    if (root / "ratings.csv").is_file():
        return root
    scratch = root.with_name(f"{root.name}.tmp-{os.getpid()}")
    scratch.mkdir(parents=True, exist_ok=True)
    write_ratings_csv(scratch / "ratings.csv", *generate_ratings(**sizes))
    try:
        os.rename(scratch, root)
    except OSError:  # another process finished first; its copy is identical
        for child in scratch.iterdir():
            child.unlink()
        scratch.rmdir()
    return root
