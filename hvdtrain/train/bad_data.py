"""Training data that vanishes mid-run: a limit, a stop with a checkpoint, and the list of bad files.

A volume unmounted under a running job, a folder deleted by a clean-up script, a file system that
answers EIO for a while: the loader replaces each failed training file with the next readable one
(data/image/folder.py), which carries a run through a few bad files, and would carry it through a
whole vanished folder too, on other data than it started with. So:

* at every step boundary the ranks sum their counts of the epoch's distinct failed files, in the
  stop agreement's allreduce (preemption.StopRequest.agreed: no collective of its own). The counts
  include the batches of the next step, which the engine takes one step ahead
  (engine.DeviceBatches), so a stop comes *before* the step that would train on the hole;
* past ``data.max_bad_fraction`` of the epoch's files, or when a sample found no readable file in
  MAX_REPLACEMENTS tries, every rank stops: a checkpoint of the last step trained on good data,
  the failed files in ``<output.dir>/bad_files.jsonl``, one line naming the share, the folder most
  affected and the first missing file, and exit code 65 (``outcome.EXIT_DATA_VANISHED``). Once the
  data is back, the same command resumes from that checkpoint;
* an epoch with failed files gets one summary line after its epoch line, and its files go to
  bad_files.jsonl (rank 0, from the records every rank gathered; ``BadFilesLog``).

Tar shards (data/shards/loader.py): a training shard that cannot be read leaves a *hole* in its
rank's batches, which no replacement fills. The loader holds the next step's batches (read and
counted, not yet in its checkpointed position) and counts a hole as a sample out of
replacements, so the same step-boundary sum stops every rank before the step that would need the
shard, whatever ``data.max_bad_fraction`` says; the line names the shard (``stop_for_vanished_data``).

Validation (``check_validation``, from outputs.end_epoch on every rank): files that fail are
dropped from the exact metrics and counted. Past ``data.max_bad_fraction`` of the split's samples in
one pass, the metrics would speak for another split: nothing of that validation is recorded (no
epoch record, no best.pt), the epoch's training is checkpointed as trained but not validated
(position: the epoch's last step), and every rank stops with one line and exit code 65. The same
command, once the data is back, resumes there (no step left to train) and validates the epoch again.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from .. import outcome
from ..comm import dist
from ..data.files.bad_files import REASONS, Summary, allowed_failures, over_limit, validation_over_limit
from ..data.image.folder import MAX_REPLACEMENTS
from ..ownership import PRIVATE, UnsafePath, open_append, own_folder
from .capabilities import FailsOnBadFile, SummarizesBadFiles, TalliesBadFiles
from .guard import JobStopped
from .run import Run, log
from .save import save_checkpoint

# The run's train.outputs.Outputs is handed in (typed Any): train/outputs.py calls check_validation,
# so this module does not import it.

BAD_FILES = "bad_files.jsonl"


class DataVanished(JobStopped):
    """Training files failed past ``data.max_bad_fraction``; a checkpoint of the last good step is
    saved and every rank leaves with exit code 65 once rank 0 has written everything."""

    exit_code = outcome.EXIT_DATA_VANISHED
    after_checkpoint = True  # run.finish: every rank waits for the others before leaving


def vanished(line: str) -> DataVanished:
    """The stop, said by rank 0 now: after the ranks' last barrier (run.finish) the launcher may end
    rank 0 as soon as another rank has left with 65. Every rank keeps it as its exit cause."""
    if dist.is_primary():
        print(line, file=sys.stderr, flush=True)
    outcome.note_cause(line)
    return DataVanished(line, speak=False)


class DataGuard:
    """Whether the training files that failed this epoch, over every rank, call for a stop."""

    def __init__(self, loader: Any, max_fraction: float):
        self.loader, self.max_fraction = loader, max_fraction
        self.epoch_files = 0
        self.totals: list[float] = [0.0] * 5
        self.tripped = False

    @classmethod
    def for_run(cls, run: Run) -> "DataGuard | None":
        """A guard where the training loader counts bad files (the image folder loader) and
        ``data.on_bad_file=skip``; None otherwise."""
        loader = run.loaders.train
        if not isinstance(loader, TalliesBadFiles) or fails_on_bad_file(loader):
            return None
        return cls(loader, run.cfg.data.max_bad_fraction)

    def start_epoch(self, epoch_files: int) -> None:
        self.epoch_files, self.tripped, self.totals = epoch_files, False, [0.0] * 5

    def vector(self) -> torch.Tensor:
        """This rank's counts so far this epoch (bad_files.EpochTally.vector), for the agreement."""
        return self.loader.tally.vector()

    def check(self, totals: torch.Tensor | None) -> bool:
        """Whether the counts summed over ranks pass the limit (the same answer on every rank)."""
        if totals is not None and not self.tripped:
            self.totals = [float(value) for value in totals]
            self.tripped = over_limit(self.totals, self.max_fraction, self.epoch_files)
        return self.tripped


class BadFilesLog:
    """Rank 0's ``bad_files.jsonl``: one JSON object per failed file per epoch and split (epoch,
    split, reason, path, error), and the run's distinct failed files, read back at a resume. A line
    that does not parse (a write cut short) is skipped; a write that fails warns once."""

    def __init__(self, run_dir: Path, share: str = PRIVATE):
        self.path, self.share = run_dir / BAD_FILES, share
        self.distinct: dict[str, str] = {}  # path -> reason, over the whole run
        self.warned = False
        try:
            with open(self.path, encoding="utf-8", errors="replace") as handle:
                for line in handle:
                    self.remember(line)
        except OSError:
            pass

    def remember(self, line: str) -> None:
        try:
            entry = json.loads(line)
        except ValueError:
            return
        if isinstance(entry, dict) and isinstance(entry.get("path"), str) and entry.get("reason") in REASONS:
            self.distinct.setdefault(entry["path"], entry["reason"])

    def write(self, epoch: int, split: str, summary: Summary | None) -> None:
        if summary is None or not summary.records:
            return
        lines = []
        for record in summary.records:
            self.distinct.setdefault(record.path, record.reason)
            lines.append(json.dumps({"epoch": epoch, "split": split, "reason": record.reason, "path": record.path,
                                     "error": record.detail}) + "\n")
        try:
            own_folder(self.path.parent, self.share, what="output folder")  # made and checked as the run folder is
            with open_append(self.path, self.share) as handle:  # never through a planted link
                handle.writelines(lines)
        except (OSError, UnsafePath) as error:
            if not self.warned:
                self.warned = True
                log(f"hvdtrain: warning: cannot write {self.path} ({getattr(error, 'strerror', None) or error}); the "
                    f"epoch lines still count the bad files")

    def run_totals(self) -> str:
        counts = {reason: 0 for reason in REASONS}
        for reason in self.distinct.values():
            counts[reason] += 1
        return f"{len(self.distinct)} distinct (" + ", ".join(f"{n} {r}" for r, n in counts.items() if n) + ")"


def take_summary(loader: Any) -> Summary | None:
    """The loader's summary of its last pass (engine.add_bad_files), once."""
    summary = loader.last_summary if isinstance(loader, SummarizesBadFiles) else None
    if summary is not None:
        loader.last_summary = None
    return summary


def where_most(summary: Summary) -> str:
    folder, count = summary.folder_most_affected()
    first = summary.first("missing")
    text = f"most in {folder}/ ({count})" if folder else ""
    if first is not None:
        return f"{text}; first missing: {first.path}"
    first = summary.first()
    return f"{text}; first: {first}" if first is not None else text


def note_epoch(run: Run, bad_log: BadFilesLog | None, epoch: int) -> None:
    """After an epoch's line: its failed files to bad_files.jsonl, and one summary line where
    there were any (rank 0; every rank pops its loaders' summaries)."""
    train, val = take_summary(run.loaders.train), take_summary(run.loaders.val)
    if bad_log is None:
        return
    bad_log.write(epoch, "train", train)
    bad_log.write(epoch, "val", val)
    parts = [f"{split} {summary.total} of {summary.files_read} ({summary.reasons()})"
             for split, summary in (("train", train), ("val", val)) if summary is not None and summary.total]
    if parts:
        worst = max((s for s in (train, val) if s is not None and s.total), key=lambda s: s.total)
        log(f"hvdtrain: bad files in epoch {epoch + 1}: {', '.join(parts)}; {where_most(worst)}; the run so far: "
            f"{bad_log.run_totals()}, listed in {bad_log.path}")


def save_for_rerun(run: Run, outputs: Any, bad_log: BadFilesLog | None, epoch: int,
                   summaries: dict[str, Summary | None], audited: bool = False) -> tuple[Any, Any]:
    """Every rank, before a stop for vanished data: the failed files listed (rank 0's ``bad_log``),
    the checkpoint a rerun resumes from (it must fit: checkpoint.DiskFull otherwise), and (its path,
    the list's path) on every rank, for the line each rank says."""
    if bad_log is not None:
        for split, summary in summaries.items():
            bad_log.write(epoch, split, summary)
    path = save_checkpoint(run, outputs.saver, audited=audited, must=True)
    # Every rank's line names it; a path travels between ranks as its text (comm/wire.py).
    path = dist.broadcast_object(None if path is None else str(path), name="hvdtrain.vanished.checkpoint")
    return path, (bad_log.path if bad_log is not None else run.run_dir / BAD_FILES)


def stop_for_vanished_data(run: Run, outputs: Any, guard: DataGuard, bad_log: BadFilesLog | None,
                           steps: int) -> None:
    """Every rank: the epoch's failed files listed, a checkpoint of the last good step, one line
    from rank 0, then DataVanished (exit code 65)."""
    position = run.state.position
    summary = take_summary(run.loaders.train) or Summary()
    path, listed = save_for_rerun(run, outputs, bad_log, position.epoch, {"train": summary})
    allowed = allowed_failures(guard.max_fraction, guard.epoch_files)
    where_stopped = (f"Stopped before global step {position.step + 1} (epoch {position.epoch + 1}, step "
                     f"{position.step_in_epoch + 1}/{steps}): the checkpoint of the last good step is {path}, the "
                     f"failed files are listed in {listed}.")
    shards = [record for record in summary.records if getattr(record, "shard", False)]
    if shards:  # a hole: no share of the limit makes up for it
        first = summary.row_end if getattr(summary.row_end, "shard", False) else shards[0]
        more = f" (and {len(shards) - 1} more shard(s))" if len(shards) > 1 else ""
        raise vanished(f"hvdtrain: training data vanished: shard {first.path} cannot be read ({first.reason}: "
                       f"{first.detail}){more}, and epoch {position.epoch + 1} needs it. {where_stopped} Restore the "
                       f"shards (remount the volume), then run the same command to resume")
    if summary.row_end is not None and summary.total <= allowed:
        cause = (f"a training sample found no readable file in {MAX_REPLACEMENTS} tries in a row, "
                 f"from {summary.row_end.path} on ({summary.total} of the {summary.files_read} files read in epoch "
                 f"{position.epoch + 1} failed: {summary.reasons()})")
    else:
        share = summary.total / max(summary.files_read, 1)
        cause = (f"{summary.total} of the {summary.files_read} training files read in epoch {position.epoch + 1} "
                 f"failed ({share:.1%}: {summary.reasons()}; data.max_bad_fraction={guard.max_fraction:g} allows "
                 f"{allowed} of the epoch's {guard.epoch_files})")
    line = (f"hvdtrain: training data vanished: {cause}; {where_most(summary)}. {where_stopped} Restore the "
            f"data (remount the volume), then run the same command to resume; or raise data.max_bad_fraction")
    raise vanished(line)


def check_validation(run: Run, outputs: Any, epoch: int) -> None:
    """After an epoch's validation, before anything of it is recorded (every rank: the summary is
    the same on each). Past ``data.max_bad_fraction`` of the split's samples failed: the failed files
    listed, a checkpoint of the epoch's training (trained, not validated), one line, DataVanished."""
    loader, max_fraction = run.loaders.val, run.cfg.data.max_bad_fraction
    summary = loader.last_summary if isinstance(loader, SummarizesBadFiles) else None
    if fails_on_bad_file(loader) or not validation_over_limit(summary, max_fraction, run.loaders.val_size):
        return
    train = take_summary(run.loaders.train)
    take_summary(loader)
    bad_log = BadFilesLog(run.run_dir, run.cfg.output.share) if dist.is_primary() else None
    path, listed = save_for_rerun(run, outputs, bad_log, epoch, {"train": train, "val": summary}, audited=True)
    split = run.loaders.val_size or summary.files_read
    raise vanished(validation_line(summary, split, max_fraction, epoch, path, listed))


def validation_line(summary: Summary, split: int, max_fraction: float, epoch: int, path: Any, listed: Any) -> str:
    return (f"hvdtrain: validation data vanished: {summary.total} of the {split} validation samples failed in "
            f"epoch {epoch + 1} ({summary.total / max(split, 1):.1%}: {summary.reasons()}; "
            f"data.max_bad_fraction={max_fraction:g} allows {allowed_failures(max_fraction, split)}); "
            f"{where_most(summary)}. Epoch {epoch + 1}'s training is saved, not validated (its metrics would leave "
            f"those samples out), in {path}; the failed files are listed in {listed}. Restore the data (remount "
            f"the volume), then run the same command: it resumes there and validates epoch {epoch + 1} again; or "
            f"raise data.max_bad_fraction")


def check_epoch_end(run: Run, guard: DataGuard | None, epoch: int, train_metrics: dict[str, Any]) -> None:
    """The epoch's exact count against the limit, after its checkpoint (a backstop: the step
    boundaries stop first, except where the engine could not take a whole step ahead)."""
    if guard is None or guard.epoch_files == 0:
        return
    failed = train_metrics.get("bad_files", 0)
    if failed > allowed_failures(guard.max_fraction, guard.epoch_files):
        raise vanished(f"hvdtrain: training data vanished: {failed} of the {guard.epoch_files} training files "
                       f"of epoch {epoch + 1} failed (data.max_bad_fraction={guard.max_fraction:g}); the epoch's "
                       f"checkpoint is saved and its files are listed in {run.run_dir / BAD_FILES}. Restore the "
                       f"data, then run the same command; or raise data.max_bad_fraction")


__all__ = ["BadFilesLog", "DataGuard", "DataVanished", "note_epoch", "stop_for_vanished_data", "check_epoch_end",
           "check_validation"]


def fails_on_bad_file(loader: Any) -> bool:
    return isinstance(loader, FailsOnBadFile) and bool(loader.fail)
