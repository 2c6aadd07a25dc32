"""Checkpoints: written atomically by rank 0, read with ``weights_only=True``.

A checkpoint is a plain dict of tensors, numbers, strings, lists and dicts, so loading it never
unpickles code. Writing goes to a temporary file in the same folder, which is flushed, fsynced
and then renamed over the target: a crash mid-write leaves the previous good file in place.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

REQUIRED_KEYS = ("model", "optimizer", "epoch", "step", "config")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used, phrased as one line naming the file."""


def atomic_save(payload: dict[str, Any], path: Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(scratch, "wb") as handle:
            torch.save(payload, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(scratch, path)
    finally:
        if scratch.exists():
            scratch.unlink()
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # make the rename itself durable
    finally:
        os.close(directory)


def load(path: Path) -> dict[str, Any]:
    """Load and sanity-check a checkpoint on the CPU, or raise CheckpointError."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint '{path}' does not exist")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # truncated zip, garbage, or a pickle with code in it
        reason = str(error).splitlines()[0][:160] if str(error) else type(error).__name__
        raise CheckpointError(f"checkpoint '{path}' is unreadable ({reason}); "
                              f"delete it or point checkpoint.resume at another file") from None
    if not isinstance(payload, dict) or any(key not in payload for key in REQUIRED_KEYS):
        raise CheckpointError(f"checkpoint '{path}' is not an hvdtrain checkpoint "
                              f"(needs keys {', '.join(REQUIRED_KEYS)})")
    return payload


def resume_path(resume: str, run_dir: Path) -> Path | None:
    """Which file ``checkpoint.resume`` asks for: auto, never, or an explicit path."""
    if resume == "never":
        return None
    if resume == "auto":
        last = run_dir / "checkpoints" / "last.pt"
        return last if last.is_file() else None
    path = Path(resume)
    if not path.is_file():
        raise CheckpointError(f"checkpoint.resume: '{resume}' is neither auto, never, nor an existing file")
    return path
