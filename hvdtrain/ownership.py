"""Whose paths hvdtrain writes into and trusts: one rule, in one place.

On a shared cluster other users can write to scratch folders (``chmod 1777``) and, where
``fs.protected_symlinks`` is off, plant links there that the kernel follows for anyone. So:

- **A folder hvdtrain writes into** (a run folder and its subfolders, a report's folder, a
  ``prepare`` destination, a cache) is the user's own, made by this run or before, and nobody else
  can write to it: not group or others (the group may, when the user shares it on purpose:
  ``share="group"``). Nobody but the user or root can swap it either: every folder above it is the
  user's or root's and not writable by group or others unless its sticky bit is set (``/tmp``,
  ``/scratch``), and no link on the way belongs to another user. Otherwise it is refused in one line
  naming the folder, its owner and the fix (``own_folder``). With ``share="group"`` the folders above
  may also be another member's (a project folder), but one the group (or anyone) can write must have
  the sticky bit too, or a member could rename another's run folder and put a different one in its
  place: refused, with ``chmod +t`` as the fix. Checkpoints go further: they are written, linked and
  pruned through a descriptor of their folder opened once (``open_folder``, ``replace_file``'s
  ``dir_fd``), so a rename after the check moves the folder they land in instead of redirecting them.
- **Files are written without following links**: a log is appended through ``O_NOFOLLOW`` and must
  then be a regular file of the user's with one name (``open_append``); anything else is written whole
  to a fresh ``O_EXCL`` temporary file in the same folder and renamed over its name (``replace_file``,
  ``write_atomic``), which replaces a planted link instead of writing through it.
- **A file read as hvdtrain's own state** (a checkpoint to resume, a cache, a sidecar of an
  unfinished ``prepare``, a shard it would adopt) is trusted only when the user or root owns it and
  nobody else can write it, checked on the descriptor that is then read (``open_trusted``,
  ``trust_problem``).

Private by default: folders are made 0700 and files 0600; ``share="group"`` gives the group read
access (0750, 0640), within the user's umask; ``share="umask"`` lets everyone read what the umask
allows (0755, 0644 within it: what the user publishes on purpose, such as prepared shards). Only
``"group"`` lets the group write the folders on the way.

Light on purpose (the standard library only): every layer, from the config to the tools, imports it.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import os
import pwd
import secrets
import stat
from pathlib import Path
from typing import IO, Callable

PRIVATE, GROUP = "private", "group"
SHARES = (PRIVATE, GROUP)
# Readable as the umask allows, writable by the user alone (0755, 0644 within the umask): for what the
# user publishes on purpose, such as prepared shards, and what a user's own script saves
# (distributed.save).
UMASK = "umask"


class UnsafePath(ValueError):
    """A path hvdtrain will not write into or trust, as one line: the path, its owner and the fix."""


def owner_name(uid: int) -> str:
    """The user name of ``uid`` (``uid 1234`` where the system knows none)."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def trusted_owner(uid: int) -> bool:
    """Whether files of ``uid`` count as this user's own: the user, or root (who can change anything anyway)."""
    return uid in (os.geteuid(), 0)


def folder_mode(share: str = PRIVATE) -> int:
    """The mode hvdtrain gives a folder it makes (the umask may take more away)."""
    return {GROUP: 0o750, UMASK: 0o755}.get(share, 0o700)


def file_mode(share: str = PRIVATE) -> int:
    """The mode hvdtrain gives a file it writes (the umask may take more away)."""
    return {GROUP: 0o640, UMASK: 0o644}.get(share, 0o600)


def current_umask() -> int:
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def private_group(gid: int, uid: int) -> bool:
    """Whether ``gid`` is the user private group of ``uid`` (Debian's and Red Hat's convention: a
    group named after the user, with no other member), whose write bit lets no one else in. Under it
    users work with umask 002, so their own folders and files are group-writable."""
    try:
        group = grp.getgrgid(gid)
    except KeyError:
        return False
    user = owner_name(uid)
    return group.gr_name == user and set(group.gr_mem) <= {user}


def writable_by_others(info: os.stat_result, share: str = PRIVATE) -> bool:
    """Whether users other than the owner can write: anyone, or the group unless shared with on
    purpose or the owner's private group."""
    if info.st_mode & stat.S_IWOTH:
        return True
    return bool(info.st_mode & stat.S_IWGRP) and share != GROUP and not private_group(info.st_gid, info.st_uid)


def describe(info: os.stat_result) -> str:
    return f"owner {owner_name(info.st_uid)}, mode {stat.S_IMODE(info.st_mode):04o}"


# --- folders hvdtrain writes into ------------------------------------------------------------------

def _above_problem(folder: Path, info: os.stat_result, share: str) -> str | None:
    """Why someone other than the user or root could swap what lies in ``folder`` (a folder above
    one hvdtrain writes into), or None."""
    if share != GROUP and not trusted_owner(info.st_uid):
        return f"the folder {folder} above it belongs to {owner_name(info.st_uid)}, who could swap it"
    if writable_by_others(info) and not info.st_mode & stat.S_ISVTX:
        whom = "anyone" if info.st_mode & stat.S_IWOTH else "its group"
        return (f"the folder {folder} above it can be written by {whom} ({describe(info)}) without the sticky bit, "
                f"so another user could rename what is in it")
    return None


def folder_problem(path: str | os.PathLike[str], share: str = PRIVATE) -> str | None:
    """Why the folder ``path`` must not be written into, or None (a missing folder: the problem of
    the folders above it, where it would be made). The reason names the path and its owner; the
    caller adds the fix."""
    path = Path(os.path.abspath(os.path.expanduser(path)))
    # Links on the way: as fs.protected_symlinks would, follow only the user's and root's.
    walked = Path(path.anchor)
    for part in path.parts[1:]:
        walked = walked / part
        try:
            info = os.lstat(walked)
        except OSError:  # missing, or under a file: made (or refused) below
            break
        if stat.S_ISLNK(info.st_mode) and not trusted_owner(info.st_uid):
            return f"{walked} is a link that {owner_name(info.st_uid)} owns (to {os.readlink(walked)})"
    real = Path(os.path.realpath(path))
    existing = real
    while not existing.exists():
        existing = existing.parent
    for folder in reversed([existing, *existing.parents] if existing != real else list(real.parents)):
        problem = _above_problem(folder, os.stat(folder), share)
        if problem:
            return problem
    if existing != real:
        return None
    info = os.stat(real)
    if not stat.S_ISDIR(info.st_mode):
        return f"{path} is not a folder"
    if info.st_uid != os.geteuid():
        return f"{path} belongs to {owner_name(info.st_uid)} ({describe(info)})"
    if writable_by_others(info, share):
        whom = "anyone" if info.st_mode & stat.S_IWOTH else "its group"
        return f"{path} can be written by {whom} ({describe(info)})"
    return None


def own_folder(path: str | os.PathLike[str], share: str = PRIVATE, what: str = "folder",
               fix: str = "use a folder of your own") -> Path:
    """The folder ``path``, made (with the folders it lacks, mode ``folder_mode(share)``) or checked:
    the user's own, and nobody else can write to it or swap it (the module docstring). Otherwise
    ``UnsafePath``: one line with ``what``, the folder, its owner and ``fix``. The folder's own
    problems (it is yours but open to others) get ``chmod`` as the first fix."""
    path = Path(os.path.expanduser(path))
    problem = folder_problem(path, share)
    if problem is None:
        try:
            missing = [folder for folder in [path, *path.parents] if not folder.exists()]
            for folder in reversed(missing):
                try:
                    os.mkdir(folder, folder_mode(share))
                except FileExistsError:
                    pass  # another rank or process made it meanwhile: checked below like any other
        except OSError as error:
            raise UnsafePath(f"cannot create the {what} '{path.absolute()}' ({error.strerror or error}): {fix}") \
                from None
        problem = folder_problem(path, share)
    if problem is None:
        return path
    own_but_open = path.is_dir() and not path.is_symlink() and path.stat().st_uid == os.geteuid() \
        and problem.startswith(f"{Path(os.path.abspath(path))} can be written")
    hint = f"run chmod go-w '{path}', or {fix}" if own_but_open else fix
    if problem.endswith("could rename what is in it"):  # a shared folder above without the sticky bit
        above = problem.removeprefix("the folder ").split(" above it ", 1)[0]
        hint = f"have its owner run chmod +t '{above}' (the sticky bit, as /tmp has), or {fix}"
    raise UnsafePath(f"the {what} '{path.absolute()}' is not safe to write into: {problem}; {hint}")


FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def folder_descriptor_problem(descriptor: int, path: str | os.PathLike[str], share: str = PRIVATE) -> str | None:
    """Why the open folder ``descriptor`` (opened as ``path``) must not be written into, or None: it
    must be the user's, and nobody else may write to it (the group only when shared with)."""
    info = os.fstat(descriptor)
    if info.st_uid != os.geteuid():
        return f"{path} belongs to {owner_name(info.st_uid)} ({describe(info)})"
    if writable_by_others(info, share):
        return f"{path} can be written by others ({describe(info)})"
    return None


def open_folder(path: str | os.PathLike[str], share: str = PRIVATE, what: str = "folder",
                fix: str = "use a folder of your own") -> int:
    """A descriptor of the folder ``path``, made or checked by ``own_folder``, opened without following
    a link and checked again on the descriptor. What is written relative to it (``replace_file``'s
    ``dir_fd``, ``os.unlink(name, dir_fd=...)``) lands in the folder that was checked, even when it,
    or a folder above it, is renamed afterwards. ``UnsafePath`` as ``own_folder``."""
    own_folder(path, share, what, fix)
    try:
        descriptor = os.open(path, FOLDER_FLAGS)
    except OSError as error:  # ELOOP: a link put there since the check
        raise UnsafePath(f"the {what} '{Path(path).absolute()}' cannot be opened as a folder "
                         f"({error.strerror or error}): {fix}") from None
    problem = folder_descriptor_problem(descriptor, path, share)
    if problem:
        os.close(descriptor)
        raise UnsafePath(f"the {what} '{Path(path).absolute()}' is not safe to write into: {problem}; {fix}")
    return descriptor


# --- files hvdtrain trusts -------------------------------------------------------------------------

def trust_problem(info: os.stat_result, path: str | os.PathLike[str], share: str = PRIVATE) -> str | None:
    """Why the file ``path`` (whose ``stat`` is ``info``) is not to be trusted as the user's own
    state, or None: not a regular file, owned by someone other than the user or root, or writable by
    others (the group too unless shared with)."""
    if not stat.S_ISREG(info.st_mode):
        return f"{path} is not a regular file"
    if not trusted_owner(info.st_uid):
        return f"{path} belongs to {owner_name(info.st_uid)} ({describe(info)})"
    if writable_by_others(info, share):
        return f"{path} can be written by others ({describe(info)})"
    return None


def open_trusted(path: str | os.PathLike[str], share: str = PRIVATE) -> int:
    """A read-only descriptor of ``path`` when it is trusted (``trust_problem``), checked on that
    descriptor, so that what is read is what was checked. A link is followed only when it is the
    user's or root's. ``UnsafePath`` (the reason, without a fix) or ``OSError`` (missing, unreadable)."""
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK  # O_NONBLOCK: a planted fifo does not block the open
    try:
        descriptor = os.open(path, flags | os.O_NOFOLLOW)
    except OSError as error:
        if error.errno != errno.ELOOP:
            raise
        link = os.lstat(path)
        if not trusted_owner(link.st_uid):
            raise UnsafePath(f"{path} is a link that {owner_name(link.st_uid)} owns") from None
        descriptor = os.open(path, flags)
    try:
        problem = trust_problem(os.fstat(descriptor), path, share)
        if problem:
            raise UnsafePath(problem)
        os.set_blocking(descriptor, True)
        return descriptor
    except BaseException:
        os.close(descriptor)
        raise


# --- writing without following links ---------------------------------------------------------------

def open_append(path: str | os.PathLike[str], share: str = PRIVATE) -> IO[str]:
    """``path`` opened to append text: made with ``file_mode(share)`` if missing, never through a
    link, and only when it is a regular file of this user's with one name (a hard link planted at
    the name would lead to another file). ``PermissionError`` (an ``OSError``, as a full disk is:
    writers that go on without a log go on) naming the reason otherwise."""
    descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                         file_mode(share))
    info = os.fstat(descriptor)
    reason = ("not a regular file" if not stat.S_ISREG(info.st_mode)
              else f"it belongs to {owner_name(info.st_uid)}" if info.st_uid != os.geteuid()
              else f"it has {info.st_nlink} names (hard links)" if info.st_nlink != 1 else "")
    if reason:
        os.close(descriptor)
        raise PermissionError(errno.EPERM, f"{path} not written: {reason}")
    os.set_blocking(descriptor, True)
    return os.fdopen(descriptor, "a", encoding="utf-8")


def replace_file(path: str | os.PathLike[str], write: Callable[[IO[bytes]], object], share: str = PRIVATE,
                 sync: bool = False, dir_fd: int | None = None) -> None:
    """Replace ``path`` with what ``write(handle)`` writes: into a fresh temporary file made with
    O_EXCL in the same folder (mode ``file_mode(share)`` within the umask), then renamed over
    ``path``. A reader sees the old file or the new one; a link planted at ``path`` is replaced, not
    written through. ``sync``: the file and its folder reach the disk before this returns.
    ``dir_fd`` (``open_folder``): ``path`` is a name in that folder, wherever it now is."""
    path = Path(path)
    folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC) if dir_fd is None else dir_fd
    scratch = f".{path.name}.{secrets.token_hex(8)}.tmp"  # a name nobody could plant
    try:
        descriptor = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                             file_mode(share) & ~current_umask(), dir_fd=folder)
        try:
            with os.fdopen(descriptor, "wb") as handle:
                write(handle)
                if sync:
                    handle.flush()
                    os.fsync(handle.fileno())
            os.replace(scratch, path.name, src_dir_fd=folder, dst_dir_fd=folder)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(scratch, dir_fd=folder)
            raise
        if sync:
            os.fsync(folder)
    finally:
        if dir_fd is None:
            os.close(folder)


def write_atomic(path: str | os.PathLike[str], data: bytes | str, share: str = PRIVATE, sync: bool = False) -> None:
    """``replace_file`` with ``data`` (text as UTF-8)."""
    payload = data.encode("utf-8") if isinstance(data, str) else data
    replace_file(path, lambda handle: handle.write(payload), share, sync)


def sync_folder(path: str | os.PathLike[str]) -> None:
    """fsync a folder, so that a rename in it survives a crash."""
    descriptor = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
