"""A shard set's manifest (hvdtrain prepare's manifest.json): its splits, shards and record counts,
read from a local folder or a URL (s3://..., through fsspec), with one line for what is missing.

Everything in it is checked before use, since anyone who can write the file can write anything:
its size, the class names, each shard's name (a file inside the folder) and image count (a number
within bounds, and, for local shards, no more than the shard's real size can hold). A bad value is
one line and exit 65 (``DamagedData``), never a traceback or an array of a size the file claims. A
local manifest or shard that anyone can write is refused as well, and so is one that is a link (a
shard named in the manifest could otherwise lead out of data.dir, to any file the user can read):
checked before training, and again when each file is opened (``O_NOFOLLOW``).
"""

from __future__ import annotations

import errno
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..files.index import DamagedData, DataError

MANIFEST = "manifest.json"


FORMAT = "hvdtrain-shards-v1"

# Bounds on what a manifest may say, far above real shard sets (ImageNet-21k: 14.2M images in a few
# thousand shards; prepare writes about 256 MB, some 2,000 images, per shard). A value beyond them,
# or of the wrong type, is one line and exit 65 (DamagedData), never an array of that size.
MAX_MANIFEST_BYTES = 64 << 20
MAX_SHARDS = 1_000_000
MAX_SHARD_IMAGES = 1 << 24
MAX_SPLIT_IMAGES = 1 << 31  # the bound a URL's counts get; a local folder's are held to the shards' sizes
MAX_CLASSES = 1_000_000   # config/checks.py's bound on model.num_classes
MIN_RECORD_BYTES = 1024   # a record's two tar headers: an image and its .cls label
# ... and the least a record occupies on disk: a sparse file has a size but no blocks behind it (a
# 16 GiB shard costs nothing), so its size alone lets a manifest claim 2^31 images, and the arrays
# sized by that count. Looser than MIN_RECORD_BYTES for file systems that compress (tar headers are
# mostly zeros; the images are not).
MIN_RECORD_ALLOCATED = 256


IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "ppm", "bmp", "pgm", "tif", "tiff", "webp")


def is_url(root: str) -> bool:
    return "://" in root


def join(root: str, name: str) -> str:
    return f"{root.rstrip('/')}/{name}"


def open_binary(path: str):
    """A local file (never through a link: ``O_NOFOLLOW``, ELOOP where it is one), or a remote one
    through fsspec (s3fs for s3://) with short connection timeouts so that an unreachable endpoint is
    reported in seconds, not after minutes of retries."""
    if not is_url(path):
        import os

        return os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb")
    fsspec = require_fsspec(path)
    options: dict[str, Any] = {}
    if path.startswith(("s3://", "s3a://")):
        options = {"config_kwargs": {"connect_timeout": 5, "read_timeout": 60, "retries": {"max_attempts": 2}}}
    return fsspec.open(path, "rb", **options).open()


def require_fsspec(path: str):
    try:
        import fsspec

        if path.startswith(("s3://", "s3a://")):
            import s3fs  # noqa: F401
    except ImportError:
        raise DataError(f"data.dir={path} needs fsspec and s3fs: pip install -e '.[s3]' "
                        f"(or make setup EXTRAS=s3)") from None
    return fsspec


def remote_error(root: str, error: Exception) -> DataError:
    """One line for what goes wrong with object storage before training starts."""
    import os

    name = type(error).__name__
    endpoint = os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL_S3") or "the AWS default endpoint"
    text = str(error).splitlines()[0] if str(error) else name
    if name in ("NoCredentialsError", "PartialCredentialsError") or "credentials" in text.lower():
        return DataError(f"no usable credentials for {root}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                         f"(or AWS_PROFILE) in the environment of every rank ({text})")
    if name in ("EndpointConnectionError", "ConnectTimeoutError", "ConnectionError", "ClientConnectorError") \
            or "connect" in text.lower():
        return DataError(f"cannot reach the object store at {endpoint} for {root}: check AWS_ENDPOINT_URL and "
                         f"the network ({name}: {text})")
    if isinstance(error, PermissionError):
        return DataError(f"access to {root} denied ({text}): check the credentials' permissions")
    return DataError(f"cannot read {join(root, MANIFEST)} ({name}: {text})")


@dataclass
class Split:
    names: list[str]
    counts: np.ndarray   # images per shard
    offsets: np.ndarray  # record id of each shard's first record (len(names) + 1 entries)

    @property
    def size(self) -> int:
        return int(self.offsets[-1])


@dataclass
class Manifest:
    root: str
    classes: list[str]
    train: Split
    val: Split


def has_manifest(root: str) -> bool:
    """Whether ``data.dir`` holds shards (data.format=auto); a URL always means shards."""
    import os

    return is_url(root) or os.path.isfile(os.path.join(os.path.expanduser(root), MANIFEST))


def read_manifest(root: str) -> Manifest:
    """The manifest of ``root`` (a folder or URL); one-line DataErrors for everything that fails."""
    if not is_url(root):
        import os

        root = os.path.expanduser(root)
    path = join(root, MANIFEST)
    try:
        with open_binary(path) as handle:
            text = handle.read(MAX_MANIFEST_BYTES + 1)
        if len(text) > MAX_MANIFEST_BYTES:
            raise DamagedData(f"{path} is larger than {MAX_MANIFEST_BYTES >> 20} MB, far beyond a manifest's size "
                              f"(ImageNet's is under 1 MB): not a manifest hvdtrain prepare wrote")
        payload = json.loads(text.decode("utf-8"))
    except DataError:
        raise
    except FileNotFoundError as error:
        if not is_url(root):
            raise DataError(f"no {MANIFEST} in data.dir={root} (prepare shards with python -m hvdtrain prepare, "
                            f"or set data.format=folder)") from None
        raise bucket_or_manifest(root, error) from None
    except (ValueError, RecursionError) as error:  # RecursionError: nesting deeper than the parser's stack
        raise DamagedData(f"{path} is not valid JSON ({str(error)[:120]}); prepare the shards again") from None
    except Exception as error:  # botocore and aiohttp errors: no common base class worth importing
        if not is_url(root):
            if isinstance(error, OSError) and error.errno == errno.ELOOP:
                raise link_error(path) from None
            raise DataError(f"cannot read {path} ({type(error).__name__}: {error})") from None
        raise remote_error(root, error) from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise DataError(f"{path} is not an hvdtrain shard manifest ({FORMAT}); prepare the shards again")
    manifest = Manifest(root, checked_classes(payload, path), checked_split(payload, "train", path),
                        checked_split(payload, "val", path))
    if len(manifest.classes) > max(manifest.train.size, 1):
        raise DamagedData(f"{path} lists {len(manifest.classes)} classes for {manifest.train.size} training images "
                          f"(prepare gives every class an image): a damaged or tampered manifest; prepare the shards "
                          f"again")
    if not is_url(root):
        check_shards_present(manifest)
    return manifest


def damaged(path: str, what: str) -> DamagedData:
    return DamagedData(f"{path}: {what}: a damaged or tampered manifest; prepare the shards again")


def checked_classes(payload: dict, path: str) -> list[str]:
    """The manifest's class names: a non-empty list of strings, at most MAX_CLASSES."""
    classes = payload.get("classes")
    if not isinstance(classes, list) or not classes or not all(isinstance(name, str) for name in classes):
        raise damaged(path, "'classes' is not a non-empty list of names")
    if len(classes) > MAX_CLASSES:
        raise damaged(path, f"{len(classes)} classes, more than the {MAX_CLASSES} hvdtrain trains (model.num_classes)")
    return list(classes)


def plain_name(name: object) -> bool:
    """A shard's name: one file name inside the data folder (no folder, no '..', no NUL)."""
    return (isinstance(name, str) and 0 < len(name) <= 255 and name not in (".", "..")
            and not any(mark in name for mark in ("/", "\\", "\0")))


def checked_split(payload: dict, name: str, path: str) -> Split:
    """One split's shard names and image counts, each checked before any array is made of them."""
    try:
        shards = payload["splits"][name]["shards"]
    except (KeyError, TypeError):
        raise damaged(path, f"no list of shards for the {name} split") from None
    if not isinstance(shards, list) or len(shards) > MAX_SHARDS:
        raise damaged(path, f"the {name} split's 'shards' is not a list of at most {MAX_SHARDS}")
    names, counts = [], []
    for number, shard in enumerate(shards):
        images = shard.get("images") if isinstance(shard, dict) else None
        if type(images) is not int or not 0 <= images <= MAX_SHARD_IMAGES:
            raise damaged(path, f"{name} shard #{number}: 'images' is {images!r}, not a count from 0 to "
                                f"{MAX_SHARD_IMAGES}")
        if not plain_name(shard.get("name")):
            raise damaged(path, f"{name} shard #{number}: the name {str(shard.get('name'))[:80]!r} is not a file "
                                f"name inside the data folder")
        names.append(shard["name"])
        counts.append(images)
    if sum(counts) > MAX_SPLIT_IMAGES:
        raise damaged(path, f"the {name} split counts {sum(counts)} images, more than {MAX_SPLIT_IMAGES}")
    array = np.array(counts, dtype=np.int64)
    return Split(names, array, np.concatenate([[0], np.cumsum(array)]).astype(np.int64))


def check_shards_present(manifest: Manifest) -> None:
    """One line, before any loader starts, where shards the manifest lists are not there (a volume
    not mounted, a copy cut short); a shard that vanishes later fails the batch that reads it. Each
    shard must also be large enough for the images the manifest counts in it (a record takes at
    least MIN_RECORD_BYTES, and MIN_RECORD_ALLOCATED of the blocks really allocated on disk: a
    sparse file is large for nothing; the reader then holds each shard to the tar headers it
    finds, read.read_records), and writable by no one but its owner and group: a data set anyone can
    change is not trained on."""
    import os
    import stat

    names = manifest.train.names + manifest.val.names
    counts = list(manifest.train.counts) + list(manifest.val.counts)
    found: dict[str, os.stat_result] = {}
    for name in names:
        try:
            found[name] = os.lstat(join(manifest.root, name))
        except OSError:
            pass
    links = [name for name in names if name in found and stat.S_ISLNK(found[name].st_mode)]
    if links:
        raise link_error(join(manifest.root, links[0]), len(links))
    missing = [name for name in names if name not in found or not stat.S_ISREG(found[name].st_mode)]
    if missing:
        raise DataError(f"{len(missing)} of the {len(names)} shards that {join(manifest.root, MANIFEST)} lists are "
                        f"missing, e.g. {join(manifest.root, missing[0])}: restore them (a volume not mounted?) or "
                        f"prepare the shards again")
    for name, count in zip(names, counts):
        info = found[name]
        allocated = info.st_blocks * 512
        if int(count) * MIN_RECORD_BYTES > info.st_size or int(count) * MIN_RECORD_ALLOCATED > allocated:
            raise damaged(join(manifest.root, MANIFEST), f"it counts {int(count)} images in {name}, a file of "
                                                          f"{info.st_size} bytes with {allocated} on disk"
                                                          f"{' (a sparse file)' if allocated < info.st_size else ''}")
    open_to_all = [name for name in [MANIFEST, *names]
                   if (found[name] if name in found else os.stat(join(manifest.root, name))).st_mode & stat.S_IWOTH]
    if open_to_all:
        raise DataError(f"{join(manifest.root, open_to_all[0])} can be written by anyone ({len(open_to_all)} file(s) "
                        f"of the shard set): whoever changes it changes what trains; have its owner run chmod o-w, "
                        f"or copy the shards to a folder of yours")


def link_error(path: str, count: int = 1) -> DamagedData:
    """One line for a file of a local shard set that is a link (exit 65), as prepare refuses links."""
    import os

    more = f", and {count - 1} more" if count > 1 else ""
    return DamagedData(f"{path} is a link (to {os.path.realpath(path)}){more}: a shard set's files are read only "
                       f"as files inside data.dir, never through a link, which could lead to any file of yours; copy "
                       f"the files there, or prepare the shards again")


def bucket_or_manifest(root: str, error: FileNotFoundError) -> DataError:
    """A missing manifest in an existing bucket, or a missing bucket."""
    import os

    protocol, rest = root.split("://", 1)
    bucket = rest.split("/", 1)[0]
    try:
        require_fsspec(root).filesystem(protocol).ls(f"{protocol}://{bucket}")
    except FileNotFoundError:
        endpoint = os.environ.get("AWS_ENDPOINT_URL") or "the AWS default endpoint"
        return DataError(f"bucket '{bucket}' does not exist at {endpoint} (data.dir={root}); create it or fix data.dir")
    except Exception as other:
        return remote_error(root, other)
    return DataError(f"no {MANIFEST} under data.dir={root}: upload the output of hvdtrain prepare there")
