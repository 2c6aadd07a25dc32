"""Checkpoints: written atomically by rank 0, read with ``weights_only=True``.

A checkpoint is a plain dict of tensors, numbers, strings, lists and dicts, so loading it never
unpickles code. Writing goes to a temporary file in the same folder, which is flushed, fsynced
and renamed over the target: a crash mid-write leaves the previous good file in place.

Layout under ``<output.dir>/checkpoints``: ``step-00001234.pt`` (the newest ``checkpoint.keep``
of them), ``last.pt`` (the newest) and ``best.pt`` (the best value of the task's validation
metric), the latter two as hard links to a numbered file where the file system allows it, so each
checkpoint is written once. They are written, linked and pruned through a descriptor of the folder
opened once (``CheckpointSaver``): a rename after the check never sends them into another run's.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import shutil
import stat
import weakref
from pathlib import Path
from typing import IO, Any, Callable

import torch

from ..ownership import PRIVATE, UnsafePath, folder_descriptor_problem, open_folder, open_trusted, replace_file
from ..redact import mask_values

REQUIRED_KEYS = ("model", "optimizer", "epoch", "step", "config")
FORMAT = 3  # 3: RunState.state_dict() + "ranks"; 2: "rng" and "rank_buffers" lists, "best_top1"
NUMBERED = re.compile(r"^step-(\d+)\.pt$")
# Horovod's examples/pytorch/pytorch_imagenet_resnet50.py: save_checkpoint writes {'model': ...,
# 'optimizer': ...} to --checkpoint-format's checkpoint-{epoch}.pth.tar after `epoch` epochs.
HOROVOD_EXAMPLE = "horovod_example"
EXAMPLE_NAME = re.compile(r"^checkpoint-(\d+)\.pth\.tar$")
EXAMPLE_KEYS = ("model", "optimizer")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used, phrased as one line naming the file."""


class DiskFull(OSError):
    """A checkpoint that did not fit: one line naming the folder, the bytes needed and free, and
    what to do. Nothing was left behind (no partial or temporary file), and the older checkpoints
    are untouched."""


# Free space kept beyond a checkpoint's expected size: the file system's own needs, and the
# metrics, logs and tracker files written next to it.
MARGIN_BYTES = 32 * 2**20
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def payload_bytes(value: Any) -> int:
    """The bytes of the tensors in a checkpoint payload (nested dicts and lists): its size on disk,
    give or take the archive's small overhead."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(payload_bytes(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return sum(payload_bytes(item) for item in value)
    return 0


def megabytes(count: float) -> str:
    return f"{count / 2**20:,.0f} MB"


def no_space(directory: Path, needed: int, keep: int, dir_fd: int | None = None) -> DiskFull:
    usage = shutil.disk_usage(directory if dir_fd is None else dir_fd)
    return DiskFull(errno.ENOSPC, f"checkpoint not written: {directory} has {megabytes(usage.free)} free and the "
                    f"checkpoint needs {megabytes(needed)} (with {megabytes(MARGIN_BYTES)} to spare); the older "
                    f"checkpoints are intact. Free space there, keep fewer (checkpoint.keep={keep}), or set "
                    f"output.dir to another file system")


def atomic_save(payload: Any, path: Path, share: str = PRIVATE, dir_fd: int | None = None) -> None:
    """Write ``payload`` to ``path`` so that ``path`` is always either the old or the new file: a
    fresh temporary file (O_EXCL, mode ``file_mode(share)``: never through a planted link), fsynced,
    renamed (ownership.replace_file). ``dir_fd``: ``path``'s name in that open folder."""
    path = Path(path)

    def write(handle: IO[bytes]) -> None:
        try:
            torch.save(payload, handle)
        except RuntimeError as error:
            # PyTorch's archive writer reports a write that failed for space as "unexpected
            # pos ...": a file system left (nearly) full by it says which it was.
            if shutil.disk_usage(path.parent if dir_fd is None else dir_fd).free < 2**20:
                raise OSError(errno.ENOSPC, f"writing {path} failed: {str(error).splitlines()[0][:200]}") \
                    from error
            raise

    replace_file(path, write, share, sync=True, dir_fd=dir_fd)


def atomic_link(source: str, target: str, dir_fd: int) -> None:
    """Make ``target`` the same file as ``source`` (names in the open folder ``dir_fd``): a hard link,
    else a copy, renamed over ``target`` atomically."""
    scratch = f".{target}.{secrets.token_hex(8)}.tmp"  # a name nobody could plant
    at = {"src_dir_fd": dir_fd, "dst_dir_fd": dir_fd}
    try:
        try:
            os.link(source, scratch, **at, follow_symlinks=False)
        except OSError:
            flags = os.O_NOFOLLOW | os.O_CLOEXEC
            with os.fdopen(os.open(source, os.O_RDONLY | flags, dir_fd=dir_fd), "rb") as original, \
                    os.fdopen(os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_EXCL | flags, 0o600,
                                      dir_fd=dir_fd), "wb") as copy:
                shutil.copyfileobj(original, copy)
                os.fchmod(copy.fileno(), stat.S_IMODE(os.fstat(original.fileno()).st_mode))
                copy.flush()
                os.fsync(copy.fileno())
        os.replace(scratch, target, **at)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(scratch, dir_fd=dir_fd)
    os.fsync(dir_fd)


def numbered(directory: Path | int) -> list[Path]:
    """Numbered checkpoints, newest first (``directory`` an open folder: their names)."""
    if isinstance(directory, int):
        with os.scandir(directory) as entries:
            names = [entry.name for entry in entries]
        found = [(int(m.group(1)), Path(name)) for name in names if (m := NUMBERED.match(name))]
    elif not directory.is_dir():
        return []
    else:
        found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := NUMBERED.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


class CheckpointSaver:
    """Rank 0's writer: numbered files, ``last.pt``, ``best.pt``, and pruning to ``keep``.

    The folder is made or checked (ownership.own_folder) and opened once, when the saver is made; every
    write, link, listing and prune after that goes through that descriptor, which each save checks
    again (still the user's, nobody else can write it). A rename of the folder, or of a folder above
    it, is not followed: the checkpoints land in the folder that was checked, wherever it now is,
    never in one put in its place (another run's, whose files stay untouched)."""

    def __init__(self, directory: Path, keep: int, share: str = PRIVATE):
        self.directory = Path(directory)
        self.keep, self.share = keep, share
        self.fd: int = open_folder(self.directory, share, what="checkpoint folder",
                                          fix="set output.dir=/a/folder/of/yours")  # UnsafePath: one line, exit 2
        self._closer = weakref.finalize(self, os.close, self.fd)

    def close(self) -> None:
        self._closer()

    def save(self, payload: dict[str, Any], is_best: bool) -> Path:
        """Write the checkpoint; ``DiskFull`` (nothing written, nothing lost) when the folder's file
        system has no room for it: checked before writing against the larger of the payload's bytes
        and the last checkpoint's size, and again on ENOSPC/EDQUOT while writing."""
        if "config" in payload:  # a password in a URL (tracking.mlflow.tracking_uri) is written as ***
            payload = {**payload, "config": mask_values(payload["config"])}
        if not self._closer.alive:
            raise ValueError(f"the checkpoint saver of {self.directory} is closed")
        problem = folder_descriptor_problem(self.fd, self.directory, self.share)
        if problem:
            raise UnsafePath(f"the checkpoint folder '{self.directory.absolute()}' is not safe to write into: "
                             f"{problem}; set output.dir=/a/folder/of/yours")
        try:
            last = os.stat("last.pt", dir_fd=self.fd, follow_symlinks=False)
            last_bytes = last.st_size if stat.S_ISREG(last.st_mode) else 0
        except FileNotFoundError:
            last_bytes = 0
        needed = max(payload_bytes(payload), last_bytes)
        if shutil.disk_usage(self.fd).free < needed + MARGIN_BYTES:
            raise no_space(self.directory, needed, self.keep, self.fd)
        try:
            return self.write(payload, is_best)
        except OSError as error:
            if error.errno in NO_SPACE:
                raise no_space(self.directory, needed, self.keep, self.fd) from None
            raise

    def write(self, payload: dict[str, Any], is_best: bool) -> Path:
        name = f"step-{payload['step']:08d}.pt" if self.keep > 0 else "last.pt"
        atomic_save(payload, self.directory / name, self.share, dir_fd=self.fd)
        if self.keep > 0:
            atomic_link(name, "last.pt", self.fd)
        if is_best:
            atomic_link(name, "best.pt", self.fd)
        for old in numbered(self.fd)[self.keep:]:
            os.unlink(old.name, dir_fd=self.fd)
        return self.directory / name


def load(path: Path, share: str | None = None) -> dict[str, Any]:
    """Load and sanity-check a checkpoint on the CPU, or raise CheckpointError. With ``share`` (a
    resume) the file must be trusted as the user's own state (hvdtrain/ownership.py: the user's or
    root's, nobody else can write it), checked on the descriptor that is then read; without it (a
    file named to ``evaluate``) it is read as any data file the user names."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint '{path}' does not exist")
    try:
        if share is None:
            handle = open(path, "rb")
        else:
            handle = os.fdopen(open_trusted(path, share), "rb")
    except UnsafePath as error:
        raise CheckpointError(f"checkpoint '{path}' is not resumed: {error}, so it could have been replaced; "
                              f"delete it (or the run folder), or copy a checkpoint you trust into a folder of "
                              f"yours and set checkpoint.resume to the copy") from None
    except OSError as error:
        raise CheckpointError(f"checkpoint '{path}' is unreadable ({error.strerror or error})") from None
    try:
        with handle:
            payload = torch.load(handle, map_location="cpu", weights_only=True)
    except Exception as error:  # truncated zip, garbage, or a pickle with code in it
        reason = str(error).splitlines()[0][:160] if str(error) else type(error).__name__
        raise CheckpointError(f"checkpoint '{path}' is unreadable ({reason}); "
                              f"delete it or point checkpoint.resume at another file") from None
    hvdtrains = isinstance(payload, dict) and all(key in payload for key in REQUIRED_KEYS)
    if not hvdtrains and (EXAMPLE_NAME.match(path.name) or (isinstance(payload, dict)
                                                            and sorted(payload) == list(EXAMPLE_KEYS))):
        return horovod_example(path, payload)
    if not isinstance(payload, dict) or any(key not in payload for key in REQUIRED_KEYS):
        raise CheckpointError(f"checkpoint '{path}' is not an hvdtrain checkpoint "
                              f"(needs keys {', '.join(REQUIRED_KEYS)}) nor Horovod's example's "
                              f"(checkpoint-EPOCH.pth.tar with keys {', '.join(EXAMPLE_KEYS)})")
    if int(payload.get("format", 2)) > FORMAT:
        raise CheckpointError(f"checkpoint '{path}' has format {payload['format']}, newer than this hvdtrain "
                              f"reads ({FORMAT}); upgrade hvdtrain")
    return upgrade(payload)


def horovod_example(path: Path, payload: Any) -> dict[str, Any]:
    """Horovod's example's checkpoint (``EXAMPLE_NAME``, the model's and the optimizer's state dicts
    and nothing else; the epochs trained from its name, as the example's resume_from_epoch) as a
    payload of this format: ``written_by`` says whose it is, and the step, the optimizer's own layout
    and every rank's state are left to resume (train/resume.py: adopt_example). Anything else in
    such a file is refused in one line: it is the example's or it is not used."""
    name = EXAMPLE_NAME.match(path.name)
    keys = sorted(payload) if isinstance(payload, dict) else []
    if keys != list(EXAMPLE_KEYS) or not all(isinstance(payload[key], dict) for key in EXAMPLE_KEYS) or not name:
        held = f"keys {', '.join(map(str, keys))}" if keys else f"a {type(payload).__name__}"
        raise CheckpointError(f"checkpoint '{path}' is not Horovod's example's: that is checkpoint-EPOCH.pth.tar "
                              f"holding the dicts {' and '.join(EXAMPLE_KEYS)} alone, this is named {path.name} "
                              f"and holds {held}")
    epochs = int(name.group(1))
    if epochs < 1:
        raise CheckpointError(f"checkpoint '{path}': the example numbers its checkpoints from 1 (the epochs "
                              f"trained), not {epochs}")
    return {"model": payload["model"], "optimizer": payload["optimizer"], "epoch": epochs, "step": 0,
            "config": {}, "ranks": [], "format": FORMAT, "written_by": HOROVOD_EXAMPLE}


def upgrade(payload: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint of an older format, in the current one (a new dict; the file is unchanged)."""
    version = int(payload.get("format", 2))
    if version >= FORMAT:
        return payload
    payload = dict(payload)
    # Format 2 (image classification only) kept the best top-1 under its own name and the per-rank
    # random states and buffers in two parallel lists.
    payload["best_metric"] = payload.pop("best_top1", None)
    rng = payload.pop("rng", None) or []
    buffers = payload.pop("rank_buffers", None) or [None] * len(rng)
    payload["ranks"] = [{"rng": generators, "buffers": own} for generators, own in zip(rng, buffers)]
    payload.setdefault("task", {"name": "image_classification"})
    payload["format"] = FORMAT
    return payload


def load_for_resume(resume: str, directory: Path, warn: Callable[[str], None],
                    share: str = PRIVATE) -> tuple[Path, dict[str, Any]] | None:
    """What ``checkpoint.resume`` asks for: ``never``, a file, or ``auto`` (or ``force``).

    ``auto`` takes ``last.pt`` and, if it is unreadable, the newest numbered checkpoint that
    loads, saying which file was skipped and why. An explicit file must load. Either way a file
    another user owns or can write is never resumed: the job stops with one line naming it, its
    owner and the fix (``load``).
    """
    if resume == "never":
        return None
    if resume not in ("auto", "force"):  # force: as auto, through a changed config (checkpoint/identity.py)
        path = Path(resume)
        if not path.is_file():
            raise CheckpointError(f"checkpoint.resume: '{resume}' is neither auto, force, never, nor an existing file")
        return path, load(path, share)
    candidates = [directory / "last.pt"] + numbered(directory)
    candidates = [p for p in candidates if p.is_file()]
    for path in candidates:
        try:
            return path, load(path, share)
        except CheckpointError as error:
            if "is not resumed" in str(error):
                raise  # planted, not damaged: no older file of that folder is trusted either
            warn(f"hvdtrain: warning: {error}; trying an older checkpoint")
    if candidates:
        raise CheckpointError(f"no readable checkpoint in '{directory}' (tried {len(candidates)}); "
                              f"set checkpoint.resume=never to start over")
    return None
