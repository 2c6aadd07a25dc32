"""A run's claim on its folder: which job owns it, and whether another may write into it.

A run folder records its owner job (``job.json``: scheduler, job id, user, host, pid; written and
read by the ownership rule, ownership.py: never through a link, trusted only when the user's), and
the run holds a lock on it (``run.lock``, fcntl: let go by the kernel when the process ends,
whatever ends it; 0600, so that a group the folder is shared with cannot hold it). Before anything
is written, rank 0 claims the folder (``claim_folder``), and the job stops in one line, every rank
alike, when

- another run holds the lock: two jobs would write one folder (checkpoints of one, ``last.pt`` of
  the other, one ``metrics.jsonl`` for both);
- the folder holds the run of another job (or of a run outside any scheduler), which this job
  would continue or overwrite without being asked: ``checkpoint.resume=<that run's checkpoint>``
  (or ``force``) asks; the folder then records this job as its owner.

A requeue of the same job continues its own run. A start that fails before anything of the run is
written (a wrong ``data.dir``, a checkpoint of another run refused) gives the folder back as it
was (``Claim.abandon``): the previous owner record, and no empty folder. Where the file system has
no locks (some Lustre and NFS mounts), the record alone says whether its job still runs: a Slurm
job that ``scontrol`` shows running, or a process alive on this host.

Light on purpose (no torch, no Horovod), like train/run_folder.py, which resolves the folder and
asks for the claim.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import subprocess
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Mapping

from .. import ownership
from ..launch.job import Job, current
from ..ownership import PRIVATE

OWNER_FILE = "job.json"
LOCK_FILE = "run.lock"
ATTEMPTS_FILE = "attempts.jsonl"  # fault/attempts.py writes it; counted here for the attempt number


@dataclass
class Claim:
    """This run's hold on its folder: the lock (kept open until ``release``) and the attempt number
    (how many attempts attempts.jsonl counted before this one)."""

    path: Path
    job: Job
    attempt: int = 0
    lock_fd: int | None = None
    notes: list[str] = field(default_factory=list)
    before: bytes | None = None  # the owner record this claim replaced (None: there was none)
    share: str = PRIVATE  # output.share: who may read what the claim writes
    made: list[Path] = field(default_factory=list)  # what the claim made: the lock file, the folder itself

    def stamp(self) -> dict[str, Any]:
        """What every metrics.jsonl record carries: the job and the attempt it was written by."""
        return {"job": self.job.id, "attempt": self.attempt}

    def release(self) -> None:
        if self.lock_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.lock_fd)  # closing releases the fcntl lock
            self.lock_fd = None

    def abandon(self) -> None:
        """A start that failed before anything of the run was written (a wrong data.dir, a checkpoint
        of another run refused): the folder as it was, the owner record given back, and no empty
        folder left where there was none."""
        with contextlib.suppress(OSError):
            if self.before is None:
                (self.path / OWNER_FILE).unlink()
            else:
                ownership.write_atomic(self.path / OWNER_FILE, self.before, self.share)
        self.release()
        for made in self.made:
            with contextlib.suppress(OSError):
                made.rmdir() if made.is_dir() else made.unlink()



class FolderRefused(Exception):
    """The run folder is another run's: one line, every rank alike."""



def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")



def read_owner(path: Path) -> dict[str, Any] | None:
    """The owner record of a run folder (None: none, not one hvdtrain wrote, or one this user may
    not trust: ownership.open_trusted)."""
    try:
        with os.fdopen(ownership.open_trusted(path / OWNER_FILE), encoding="utf-8") as handle:
            record = json.loads(handle.read(1 << 16))
    except (OSError, ValueError):  # ownership.UnsafePath is a ValueError
        return None
    return record if isinstance(record, dict) else None



def owner_key(record: Mapping[str, Any] | None) -> str:
    if not record or not record.get("job"):
        return ""
    return f"{record.get('scheduler') or ''}:{record.get('cluster') or ''}:{record['job']}"



def owner_label(record: Mapping[str, Any]) -> str:
    who = f"{record.get('scheduler') or 'a'} job {record['job']}" if record.get("job") else \
        "a run outside any scheduler job"
    where = ", ".join(part for part in (f"user {record['user']}" if record.get("user") else "",
                                        f"host {record['host']}" if record.get("host") else "",
                                        f"pid {record['pid']}" if record.get("pid") else "",
                                        f"since {record['since']}" if record.get("since") else "") if part)
    return f"{who} ({where})" if where else who



def holds_a_run(path: Path) -> bool:
    """Whether ``path`` holds a run's outputs another start would continue or mix with."""
    checkpoints = path / "checkpoints"
    return (path / "metrics.jsonl").exists() or (checkpoints.is_dir() and any(checkpoints.glob("*.pt")))



def count_attempts(path: Path) -> int:
    """How many attempts started on this folder before (``start`` lines of attempts.jsonl)."""
    try:
        with open(path / ATTEMPTS_FILE, encoding="utf-8") as handle:
            return sum(1 for line in handle if '"event": "start"' in line)
    except OSError:
        return 0



def take_lock(path: Path) -> tuple[int | None, str]:
    """(the lock's file descriptor, "") when this process holds the folder's lock now; (None, "held")
    when another process does; (None, "unsupported") where the file system has no locks.

    The lock file is 0600 whatever output.share says, opened without following a link, and the user's:
    a member of the group a run folder is shared with cannot open it, so cannot hold a lock that keeps
    the user's runs out. One an older hvdtrain left readable by others is replaced by a fresh one when
    nobody holds it, and refused in one line when somebody does."""
    for _ in range(8):  # a lock file replaced by another start meanwhile: again, on the new one
        fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
        info = os.fstat(fd)
        try:
            problem = ownership.trust_problem(info, path / LOCK_FILE)
            if problem:
                raise FolderRefused(f"the output folder's lock file is not this user's own ({problem}): remove "
                                    f"it, or use another output.dir")
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            now_there = os.stat(path / LOCK_FILE, follow_symlinks=False)
            if info.st_mode & 0o077 or (now_there.st_dev, now_there.st_ino) != (info.st_dev, info.st_ino):
                if info.st_mode & 0o077:  # an older hvdtrain's (0640): others may hold it open
                    ownership.write_atomic(path / LOCK_FILE, b"")
                os.close(fd)  # the lock that counts is the new file's
                continue
        except OSError as error:
            os.close(fd)
            if error.errno not in (errno.EAGAIN, errno.EACCES):
                if error.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    return None, "unsupported"
                raise
            if info.st_mode & 0o077:
                raise FolderRefused(f"the output folder's lock file {path / LOCK_FILE} can be opened by others "
                                    f"({ownership.describe(info)}, an older hvdtrain's) and is locked: if no run "
                                    f"of yours uses '{path.absolute()}', delete that file and start again") from None
            return None, "held"
        except FolderRefused:
            os.close(fd)
            raise
        return fd, ""
    raise FolderRefused(f"the output folder's lock file {path / LOCK_FILE} kept being replaced: another start "
                        f"uses '{path.absolute()}'; {own_folder_hint(current())}")



def still_running(record: Mapping[str, Any], scontrol: Callable[[str], str | None] | None = None) -> bool:
    """Without locks: whether the run a record names still runs (its Slurm job running, as
    ``scontrol`` shows it, or its process alive on this host)."""
    if record.get("scheduler") == "Slurm" and record.get("job"):
        state = (scontrol or slurm_job_state)(str(record["job"]))
        if state is not None:
            return state.split("+")[0] in ("RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "STOPPED")
    if record.get("host") == socket.gethostname() and isinstance(record.get("pid"), int):
        try:
            os.kill(record["pid"], 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return False



def slurm_job_state(job_id: str) -> str | None:
    try:
        shown = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    for word in shown.stdout.split():
        if word.startswith("JobState="):
            return word.split("=", 1)[1]
    return None



def asked_to_continue(resume: str) -> bool:
    """``checkpoint.resume`` naming a checkpoint file, or ``force``: the user asks to continue a
    run whatever started it (``auto``, the default, continues only this job's own)."""
    return resume not in ("auto", "never")



def own_folder_hint(job: Job) -> str:
    return ("give this job a folder of its own (output.dir=/a/new/folder"
            + (", or leave output.dir unset: runs/<job name>-<job id>" if job.id else "") + ")")



def claim_folder(path: Path, resume: str, job: Job | None = None,
                 running: Callable[[Mapping[str, Any]], bool] = still_running, share: str = PRIVATE) -> Claim:
    """Rank 0: take ``path`` for this run (see the module docstring), or raise FolderRefused with
    the one line that says why not. The owner record is written here; the caller keeps the claim
    until the run ends (``Claim.release``)."""
    job = current() if job is None else job
    owner = read_owner(path)
    had_lock = (path / LOCK_FILE).exists()
    fd, lock_state = take_lock(path)
    result = Claim(path, job, count_attempts(path), fd, before=owner_bytes(path) if owner else None,
                   made=[] if had_lock else [path / LOCK_FILE], share=share)
    try:
        if lock_state == "held":
            same_job = bool(owner) and owner_key(owner) == job.key and bool(job.key)
            if not (same_job and (owner.get("restart") or 0) < (job.restart or 0)):
                who = owner_label(owner) if owner else "another run"
                raise FolderRefused(f"the output folder '{path.absolute()}' is in use by {who}: two runs would write "
                                    f"one folder; {own_folder_hint(job)}, or wait for that run to end")
            # This job's earlier attempt: ended (a requeued job starts after it), its lock not yet let go
            # (a file server that has not noticed the old host's end). Go on without the lock.
            result.notes.append(f"hvdtrain: warning: the output folder's lock is still held for this job's earlier "
                                f"attempt (restart {owner.get('restart')}); going on without it")
        elif lock_state == "unsupported" and owner and (owner_key(owner) != job.key or not job.key) \
                and owner.get("pid") != os.getpid() and running(owner):
            raise FolderRefused(f"the output folder '{path.absolute()}' is in use by {owner_label(owner)}: two runs "
                                f"would write one folder; {own_folder_hint(job)}, or wait for that run to end")
        if owner_key(owner) != job.key and (owner is not None or job.key) and holds_a_run(path) \
                and not asked_to_continue(resume):
            started = owner_label(owner) if owner else "a run that records no owner job (an older hvdtrain's)"
            raise FolderRefused(
                f"the output folder '{path.absolute()}' holds the run of {started}, not of this job "
                f"({job.label()}): continue it on purpose with "
                f"checkpoint.resume={path / 'checkpoints' / 'last.pt'} (or checkpoint.resume=force), or "
                f"{own_folder_hint(job)}")
        write_owner(path, job, owner, share)
    except BaseException:
        result.release()
        raise
    return result



def owner_bytes(path: Path) -> bytes | None:
    try:
        with os.fdopen(ownership.open_trusted(path / OWNER_FILE), "rb") as handle:
            return handle.read(1 << 16)
    except (OSError, ValueError):
        return None



def write_owner(path: Path, job: Job, before: Mapping[str, Any] | None, share: str = PRIVATE) -> None:
    """The owner record, replaced in one step (a reader never sees half of it)."""
    record: dict[str, Any] = {**job.record(), "user": user(), "host": socket.gethostname(), "pid": os.getpid(),
                              "since": now()}
    if before and owner_key(before) != job.key:
        record["continues"] = {k: before.get(k) for k in ("scheduler", "job", "cluster", "user")}
    elif before and before.get("continues"):
        record["continues"] = before["continues"]
    ownership.write_atomic(path / OWNER_FILE, json.dumps(record) + "\n", share)



def user() -> str:
    try:
        import pwd

        return pwd.getpwuid(os.geteuid()).pw_name
    except (ImportError, KeyError):
        return str(os.geteuid())
