"""What the training loop may find on a loader or a membership policy beyond iterating it, as
Protocols: each one capability, with what it means. They are structural (typing.Protocol) because
data/ is below train/ and does not import it: a loader has a capability by having its members
(data/image/folder.py's CountingLoader, data/shards/taking.py's ShardLoader), and the loop asks
``isinstance(loader, CountsBadFiles)`` where it reads one. Every rank has the same kind of loader,
so every rank takes the same branch (some of them are collectives).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class CountsBadFiles(Protocol):
    """A loader that counts the files it could not read. ``counts_bad_files`` (True): the engine
    takes a step's batches one step ahead (engine.DeviceBatches), so that the ranks agree on a stop
    for vanished data before the step that would train on them."""

    counts_bad_files: bool


@runtime_checkable
class TalliesBadFiles(Protocol):
    """``tally``: this rank's bad files of the pass under way (bad_files.EpochTally), which
    train/bad_data.py's DataGuard weighs against data.max_bad_fraction step by step."""

    tally: Any


@runtime_checkable
class PopsBadFiles(Protocol):
    """``pop_epoch()`` hands this rank's tally of the pass over and starts the next pass's
    (engine.add_bad_files combines the ranks' at the end of each pass: a collective)."""

    def pop_epoch(self) -> Any: ...


@runtime_checkable
class SummarizesBadFiles(Protocol):
    """``last_summary``: the bad_files.Summary of the loader's last pass over every rank (written by
    engine.add_bad_files, taken by train/bad_data.py once; None when taken or none yet)."""

    last_summary: Any


@runtime_checkable
class FailsOnBadFile(Protocol):
    """``fail``: data.on_bad_file=fail: the loader stops at the first bad file itself."""

    fail: bool


@runtime_checkable
class CountsTakenBatches(Protocol):
    """A loader whose position counts the batches taken (tar shards): ``counts_taken_batches``
    (True) tells the engine to take nothing ahead and prefetch nothing (it would count), and
    ``hold_ahead(ahead, count)`` has the loader read ``ahead`` batches beyond the one taken itself,
    at most ``count`` in the pass, read and counted but not taken."""

    counts_taken_batches: bool

    def hold_ahead(self, ahead: int, count: int | None) -> None: ...


@runtime_checkable
class CarriesEpochSums(Protocol):
    """A membership policy (trainer.Static; not elastic.Elastic, whose commits carry them) that gives
    a mid-epoch checkpoint the epoch's training sums so far over every rank: ``sums_so_far(run,
    sums)``, a collective."""

    def sums_so_far(self, run: Any, sums: Any) -> Any: ...
