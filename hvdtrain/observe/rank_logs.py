"""What a run says about its ranks, sized for a thousand of them.

A line per rank is fine at 2 ranks and a flood at 512. So:

- the rank-to-host map is printed as ranges per host (``node0: ranks 0-7, node1: ranks 8-15``)
  and written in full to ``ranks.tsv`` in the output folder (rank, host, pid);
- stragglers: the worst ``STRAGGLERS_SHOWN`` get a line each, the rest one line with their count;
- a warning that every rank (or many) raises, e.g. a third-party library's, is printed once, by
  rank 0, with the number of ranks that raised it and how often (``WarningTally``);
- the per-rank part of an epoch's record (``by_rank``, the full straggler list) goes to
  ``metrics_ranks.jsonl``, so that metrics.jsonl stays a few hundred bytes per epoch at any size.
  ``read_records`` puts the two back together, and reads older run folders, whose metrics.jsonl
  held the per-rank part itself, the same way.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import warnings
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from ..ownership import PRIVATE, write_atomic

RANKS_FILE = "metrics_ranks.jsonl"
HOST_MAP_FILE = "ranks.tsv"
STRAGGLERS_SHOWN = 5       # straggler lines per epoch; the rest are counted in one more line
HOSTS_SHOWN = 16           # hosts in the start-up line's map (and about MAP_CHARS); all in ranks.tsv
MAP_CHARS = 300
WARNINGS_KEPT = 50         # distinct warning messages a process counts (more are counted as one)
WARNING_TEXT_CHARS = 300   # a warning's message is cut here (a path or a tensor's repr can be long)
# The most of a metrics file that is read (hvdtrain report holds its records in memory): metrics.jsonl
# takes a few hundred bytes an epoch (100,000 epochs, train.epochs' bound, in about 100 MB), the
# per-rank part about 150 bytes a rank an epoch. A file beyond, a sparse one of any size included,
# is refused in one line, before a byte of it is read.
MAX_METRICS_BYTES = 256 << 20
MAX_RANKS_BYTES = 1 << 30


class TooLarge(ValueError):
    """A metrics file larger than any run writes (one line)."""


# --- the rank-to-host map ----------------------------------------------------------------------
def rank_ranges(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 8, 9]`` -> ``0-3,8-9``; ``[5]`` -> ``5``."""
    ordered = sorted(set(ranks))
    parts: list[str] = []
    start = previous = None
    for rank in ordered + [None]:
        if rank is not None and previous is not None and rank == previous + 1:
            previous = rank
            continue
        if start is not None:
            parts.append(str(start) if start == previous else f"{start}-{previous}")
        start = previous = rank
    return ",".join(parts)


def host_map(hosts_by_rank: Sequence[tuple[int, str]], shown: int = HOSTS_SHOWN, chars: int = MAP_CHARS) -> str:
    """``[(0, "node0"), (1, "node0"), (2, "node1")]`` -> ``node0: ranks 0-1, node1: rank 2``: the
    hosts in the order of their first rank, at most ``shown`` of them and about ``chars``
    characters (ranks placed round robin make no ranges), then how many more."""
    ranks: dict[str, list[int]] = {}
    for rank, host in sorted(hosts_by_rank):
        ranks.setdefault(host, []).append(rank)
    parts: list[str] = []
    for host, own in ranks.items():
        if len(parts) == shown or (parts and sum(len(p) + 2 for p in parts) > chars):
            break
        parts.append(f"{host}: rank{'s' if len(own) > 1 else ''} {rank_ranges(own)}")
    hidden = len(ranks) - len(parts)
    if hidden:
        parts.append(f"... {hidden} more host{'s' if hidden > 1 else ''} ({HOST_MAP_FILE})")
    return ", ".join(parts)


def write_host_map(run_dir: Path, rows: Sequence[tuple[int, str, int]], share: str = PRIVATE) -> Path | None:
    """Every rank's host and pid, one line each, to ``run_dir/ranks.tsv`` (rank 0), replacing the file
    (never writing through a link: ownership.write_atomic). A write that fails costs the file, not the
    run (the disk-full rule of metrics.jsonl)."""
    path = run_dir / HOST_MAP_FILE
    try:
        write_atomic(path, "rank\thost\tpid\n" + "".join(f"{r}\t{h}\t{p}\n" for r, h, p in sorted(rows)), share)
    except OSError as error:
        print(f"hvdtrain: warning: writing {path} failed ({error.strerror or error}); training goes on",
              file=sys.stderr, flush=True)
        return None
    return path


# --- stragglers --------------------------------------------------------------------------------
def straggler_lines(stragglers: Sequence[dict[str, Any]], threshold: float, world_size: int,
                    line: Any, shown: int = STRAGGLERS_SHOWN) -> list[str]:
    """The worst ``shown`` stragglers (``stragglers`` is slowest first) a line each by ``line``, and
    the others in one line with their count and hosts."""
    lines = [line(s) for s in stragglers[:shown]]
    rest = stragglers[shown:]
    if rest:
        hosts = sorted({s["host"] for s in rest})
        lines.append(f"hvdtrain: stragglers: {len(rest)} more rank(s) of {world_size} over "
                     f"{100 * threshold:.0f}% slower than the median (up to {100 * rest[0]['slower']:.0f}%), on "
                     + (", ".join(hosts) if len(hosts) <= 4 else f"{len(hosts)} hosts")
                     + f": every one in {RANKS_FILE}")
    return lines


# --- per-rank detail in its own file -----------------------------------------------------------
def split_record(record: dict[str, Any], shown: int = STRAGGLERS_SHOWN) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """An epoch's record -> (what metrics.jsonl keeps, the per-rank part for metrics_ranks.jsonl or
    None). metrics.jsonl keeps the worst ``shown`` stragglers and their total count."""
    if "by_rank" not in record and "stragglers" not in record:
        return record, None
    small = {k: v for k, v in record.items() if k not in ("by_rank", "stragglers")}
    detail = {"split": record.get("split"), "epoch": record.get("epoch"), "step": record.get("step")}
    if "by_rank" in record:
        detail["by_rank"] = record["by_rank"]
    stragglers = record.get("stragglers")
    if stragglers:
        small["stragglers"] = stragglers[:shown]
        small["stragglers_total"] = len(stragglers)
        detail["stragglers"] = stragglers
    return small, detail


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl with each record's per-rank part from metrics_ranks.jsonl put back (``by_rank``,
    the full ``stragglers``). A run folder from before the split has it inline and reads the same.
    Lines that are not JSON (a write cut short by a full disk) are skipped."""
    return attach_rank_detail(read_jsonl(run_dir / "metrics.jsonl"), run_dir)


def attach_rank_detail(records: list[dict[str, Any]], run_dir: Path) -> list[dict[str, Any]]:
    """``records`` of ``run_dir``'s metrics.jsonl, each given its per-rank part from
    metrics_ranks.jsonl (matched by split, epoch and step), where that file has one."""
    details = {(d.get("split"), d.get("epoch"), d.get("step")): d
               for d in read_jsonl(run_dir / RANKS_FILE, MAX_RANKS_BYTES)}
    for record in records:
        detail = details.get((record.get("split"), record.get("epoch"), record.get("step")))
        if detail is not None:
            record.update({k: v for k, v in detail.items() if k in ("by_rank", "stragglers")})
    return records


def read_jsonl(path: Path, max_bytes: int = MAX_METRICS_BYTES) -> list[dict[str, Any]]:
    """The objects of a JSON-lines file (none where it is missing); lines that are not JSON objects
    are skipped. TooLarge past ``max_bytes``."""
    records = []
    try:
        for _, line in stream_lines(path, max_bytes):
            try:
                value = json.loads(line)
            except ValueError:  # not JSON, or not UTF-8
                continue
            if isinstance(value, dict):
                records.append(value)
    except FileNotFoundError:
        return []
    return records


def stream_lines(path: Path, max_bytes: int) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of the regular file ``path``, read as a stream and never more than
    ``max_bytes`` of it: a larger file (a sparse one costs nothing to make) is refused before its
    first line is read, one that grows past the bound while it is read at that point (TooLarge).
    FileNotFoundError where ``path`` is missing or not a regular file (a FIFO does not block:
    O_NONBLOCK)."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(descriptor, "rb") as handle:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):
            raise FileNotFoundError(f"{path} is not a regular file")
        if info.st_size > max_bytes:
            raise TooLarge(too_large(path, info.st_size, max_bytes))
        taken, number = 0, 0
        while True:
            line = handle.readline(max_bytes - taken + 1)
            if not line:
                return
            taken += len(line)
            if taken > max_bytes:
                raise TooLarge(too_large(path, taken, max_bytes))
            number += 1
            yield number, line


def too_large(path: Path, size: int, max_bytes: int) -> str:
    return (f"{path} holds more than {max_bytes >> 20} MiB ({size} bytes), far more than a run writes there (a "
            f"few hundred bytes an epoch): damaged, sparse or not hvdtrain's; nothing of it was read")


# --- warnings, once per run with their count ---------------------------------------------------
class WarningTally:
    """Counts this process's warnings by message; prints only what ``speak`` allows.

    Installed as ``warnings.showwarning`` in every rank (``install``; the filters stay Python's, so
    a count is of the warnings Python would have shown: once per place in the code, by default).
    Rank 0 (``speak``) prints a message the first time it sees it, as Python would; other ranks
    print nothing. ``take()`` hands the counts since the last call to
    the epoch's gather (``observe.add_rank_report``), where rank 0 prints each message that came
    from other ranks, or again and again, once, with its counts (``summary_lines``)."""

    def __init__(self, speak: bool):
        self.speak = speak
        self.counts: dict[str, int] = {}
        self.printed: set[str] = set()
        self.said: set[str] = set()  # rank 0: the messages summary_lines has said in this run
        self.original = warnings.showwarning

    def install(self) -> "WarningTally":
        warnings.showwarning = self.show
        return self

    def uninstall(self) -> None:
        if warnings.showwarning == self.show:
            warnings.showwarning = self.original

    def show(self, message: Any, category: type, filename: str, lineno: int, file: Any = None,
             line: str | None = None) -> None:
        text = f"{category.__name__}: {str(message).strip()}"[:WARNING_TEXT_CHARS]
        if text not in self.counts and len(self.counts) >= WARNINGS_KEPT:
            text = "(other warnings)"
        self.counts[text] = self.counts.get(text, 0) + 1
        if self.speak and text not in self.printed:
            self.printed.add(text)
            self.original(message, category, filename, lineno, file, line)

    def take(self) -> dict[str, int]:
        counts, self.counts = self.counts, {}
        return counts


def summary_lines(tallies: Sequence[dict[str, int]], already: set[str], epoch: int) -> list[str]:
    """Every rank's ``WarningTally.take()`` (in rank order) -> one line per message, said once per
    run: a message only rank 0 raised once was printed when it came and gets no line. ``already``
    holds the messages said so far, and is updated."""
    ranks: dict[str, int] = {}
    total: dict[str, int] = {}
    for tally in tallies:
        for text, count in tally.items():
            ranks[text] = ranks.get(text, 0) + 1
            total[text] = total.get(text, 0) + count
    lines = []
    for text in sorted(total, key=lambda t: (-ranks[t], -total[t], t)):
        if text in already:
            continue
        already.add(text)
        if ranks[text] == 1 and total[text] == 1 and text in tallies[0]:
            continue  # rank 0's own, printed as it came
        lines.append(f"hvdtrain: warning from {ranks[text]} of {len(tallies)} rank(s), {total[text]} time(s) in "
                     f"epoch {epoch + 1} (said once): {text}")
    return lines
