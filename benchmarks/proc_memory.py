"""What a process tree costs in memory, from /proc (Linux): PSS, private memory, and the part that
is hvdtrain's file list (``benchmarks/data_scale.py``)."""

from __future__ import annotations

import os
import threading
import time


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    parent = int(handle.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def memory(pid: int, detail: bool = False) -> dict[str, int]:
    """PSS and private bytes of one process (0 when it is gone); with ``detail`` also ``list``, the
    PSS of the file list's pages (the index cache file's, or the anonymous memory file's), and
    ``own``: its anonymous and shared memory plus those pages, which only this job's processes
    map (library pages also count in other jobs' PSS: the total moves with them)."""
    fields = {"Pss": 0, "Private_Clean": 0, "Private_Dirty": 0, "Pss_Anon": 0, "Pss_Shmem": 0}
    index_file = list_shmem = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as handle:
            for line in handle:
                name, _, rest = line.partition(":")
                if name in fields:
                    fields[name] = int(rest.split()[0]) * 1024
        if detail:
            with open(f"/proc/{pid}/smaps") as handle:
                mapping = ""
                for line in handle:
                    if "-" in line.split(" ", 1)[0]:  # a mapping's first line: address range ... path
                        mapping = line
                    elif line.startswith("Pss:") and "/file-index/" in mapping:
                        index_file += int(line.split()[1]) * 1024
                    elif line.startswith("Pss:") and "memfd:hvdtrain-file-list" in mapping:
                        list_shmem += int(line.split()[1]) * 1024
    except OSError:
        pass
    return {"pss": fields["Pss"], "private": fields["Private_Clean"] + fields["Private_Dirty"],
            "own": fields["Pss_Anon"] + fields["Pss_Shmem"] + index_file, "list": index_file + list_shmem}


class PssPeak(threading.Thread):
    """The largest sum of PSS over this process and its descendants, sampled every 0.1 s."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak, self.running = 0, True

    def sample(self) -> int:
        pids = [os.getpid(), *descendants(os.getpid())]
        total = sum(memory(pid)["pss"] for pid in pids)
        self.peak = max(self.peak, total)
        return total

    def run(self) -> None:
        while self.running:
            self.sample()
            time.sleep(0.1)
