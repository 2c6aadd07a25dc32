"""The verdict on one run of Horovod's own test_torch.py (scripts/horovod-tests.sh runs it):

    python scripts/horovod_tests_verdict.py FOLDER CONTROLLER SECONDS

FOLDER holds each rank's JUnit report (rank0.xml, rank1.xml) and horovodrun.log. The run passes when
every test passed or skipped on both ranks, except EXPECTED_FAILURES, which must fail with
EXPECTED_MESSAGE; a rank without a report (aborted or killed), an abort in the log, or any other
failure fails it. Prints one line (and each problem on stderr), writes it to FOLDER/result.txt, and
exits 1 on a failed run. tests/unit/test_horovod_tests_verdict.py loads this file by path."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

# Failing with torch >= 2.9, Horovod's build and patches aside: each builds every subclass of
# torch.optim.Optimizer over a model with 1-d parameters, and Muon (torch.optim.Muon) refuses them.
# They fail the same on an unpatched Horovod.
EXPECTED_FAILURES = ("test_broadcast_state", "test_broadcast_state_options", "test_force_allreduce")
EXPECTED_MESSAGE = "Muon only supports 2D parameters"
ABORT_SIGNS = ("Fatal Python error", "terminate called")
RANKS = (0, 1)


def verdict(folder: Path) -> tuple[str, list[str]]:
    """The run's counts ('102 passed, 10 skipped, 3 failed as expected') and its problems."""
    problems: list[str] = []
    summary = None
    for rank in RANKS:
        report = folder / f"rank{rank}.xml"
        if not report.is_file():
            problems.append(f"rank {rank} wrote no report: it aborted or was killed (see {folder / 'horovodrun.log'})")
            continue
        counts = {"passed": 0, "skipped": 0, "failed as expected": 0}
        failing: dict[str, str] = {}
        for case in ET.parse(report).iter("testcase"):
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            if bad is not None:
                failing[case.get("name")] = (bad.get("message") or "") + (bad.text or "")
            elif case.find("skipped") is not None:
                counts["skipped"] += 1
            else:
                counts["passed"] += 1
        for name in EXPECTED_FAILURES:
            if name not in failing:
                problems.append(f"rank {rank}: {name} was expected to fail (Muon) and did not: "
                                "drop it from scripts/horovod_tests_verdict.py")
            elif EXPECTED_MESSAGE not in failing[name]:
                problems.append(f"rank {rank}: {name} failed, but not with '{EXPECTED_MESSAGE}'")
            else:
                counts["failed as expected"] += 1
        problems += [f"rank {rank}: {name} failed" for name in sorted(set(failing) - set(EXPECTED_FAILURES))]
        line = ", ".join(f"{n} {what}" for what, n in counts.items())
        if summary not in (None, line):
            problems.append(f"the ranks disagree: rank 0 {summary}; rank 1 {line}")
        summary = summary or line
    log = folder / "horovodrun.log"
    text = log.read_text(errors="replace") if log.is_file() else ""
    problems += [f"the log shows '{sign}': a rank aborted" for sign in ABORT_SIGNS if sign in text]
    return summary or "no report", problems


def main(argv: list[str]) -> int:
    folder, controller, seconds = Path(argv[0]), argv[1], argv[2]
    summary, problems = verdict(folder)
    for problem in problems:
        print(f"[horovod-tests] {controller}: {problem}", file=sys.stderr)
    line = f"{controller}: {'FAILED' if problems else 'ok'}: {summary} ({seconds} s)"
    print(f"[horovod-tests] {line}")
    (folder / "result.txt").write_text(line + "\n")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
