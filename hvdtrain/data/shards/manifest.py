"""A shard set's manifest (hvdtrain prepare's manifest.json): its splits, shards and record counts,
read from a local folder or a URL (s3://..., through fsspec), with one line for what is missing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..files.index import DataError


MANIFEST = "manifest.json"


FORMAT = "hvdtrain-shards-v1"


IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "ppm", "bmp", "pgm", "tif", "tiff", "webp")


def is_url(root: str) -> bool:
    return "://" in root


def join(root: str, name: str) -> str:
    return f"{root.rstrip('/')}/{name}"


def open_binary(path: str):
    """A local file, or a remote one through fsspec (s3fs for s3://) with short connection timeouts
    so that an unreachable endpoint is reported in seconds, not after minutes of retries."""
    if not is_url(path):
        return open(path, "rb")
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
            payload = json.loads(handle.read().decode("utf-8"))
    except DataError:
        raise
    except FileNotFoundError as error:
        if not is_url(root):
            raise DataError(f"no {MANIFEST} in data.dir={root} (prepare shards with python -m hvdtrain prepare, "
                            f"or set data.format=folder)") from None
        raise bucket_or_manifest(root, error) from None
    except ValueError as error:
        raise DataError(f"{path} is not valid JSON ({error}); prepare the shards again") from None
    except Exception as error:  # botocore and aiohttp errors: no common base class worth importing
        if not is_url(root):
            raise DataError(f"cannot read {path} ({type(error).__name__}: {error})") from None
        raise remote_error(root, error) from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise DataError(f"{path} is not an hvdtrain shard manifest ({FORMAT}); prepare the shards again")

    def split(name: str) -> Split:
        shards = payload["splits"][name]["shards"]
        counts = np.array([shard["images"] for shard in shards], dtype=np.int64)
        return Split([shard["name"] for shard in shards], counts, np.concatenate([[0], np.cumsum(counts)]))

    manifest = Manifest(root, list(payload["classes"]), split("train"), split("val"))
    if not is_url(root):
        check_shards_present(manifest)
    return manifest


def check_shards_present(manifest: Manifest) -> None:
    """One line, before any loader starts, where shards the manifest lists are not there (a volume
    not mounted, a copy cut short); a shard that vanishes later fails the batch that reads it."""
    import os

    names = manifest.train.names + manifest.val.names
    missing = [name for name in names if not os.path.isfile(join(manifest.root, name))]
    if missing:
        raise DataError(f"{len(missing)} of the {len(names)} shards that {join(manifest.root, MANIFEST)} lists are "
                        f"missing, e.g. {join(manifest.root, missing[0])}: restore them (a volume not mounted?) or "
                        f"prepare the shards again")


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
