"""Does ``hvdtrain doctor`` always answer? Run the two-node doctor N times in a row and count.

    sudo .venv/bin/python benchmarks/doctor_repeat.py                 # 10 runs
    sudo .venv/bin/python benchmarks/doctor_repeat.py --runs 5 -- --controllers mpi --network-interfaces lo,eth0

Starts the two ssh "machines" of the test harness (tests/multinode/nodes.py: node0 and node1 on
127.0.0.2/127.0.0.3, needs root; sessions that share the box take turns through its lock file),
runs ``python -m hvdtrain doctor -H node0:1,node1:1`` plus the arguments after ``--``, prints
each run's exit status and wall time, checks that no launcher or rank of the run is left
behind, and ends with a summary such as "finished 10/10, median 41 s, max 55 s" (finished: exit
status 0). The nodes are stopped at the end, also after Ctrl-C.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hvdtrain.tools.process import run_with_deadline  # noqa: E402
from tests.multinode.nodes import BIN, TwoNodes, unavailable_reason  # noqa: E402


def left_behind(cwd: Path) -> list[int]:
    """Processes of a run still alive in its directory: the doctor's launchers and bench ranks (the
    ranks "on" node0 and node1 run on this box too, in the same directory)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and b"--bench" in (entry / "cmdline").read_bytes() \
                    and (entry / "cwd").resolve() == cwd.resolve():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10, help="doctor runs in a row (default: 10)")
    parser.add_argument("--limit", type=float, default=600,
                        help="seconds after which a run counts as hung and is ended (default: 600)")
    parser.add_argument("doctor_args", nargs="*", help="after --: more arguments for the doctor")
    args = parser.parse_args()
    reason = unavailable_reason()
    if reason:
        print(f"doctor_repeat: {reason}", file=sys.stderr)
        return 2

    with tempfile.TemporaryDirectory(prefix="doctor-repeat-") as scratch:
        workdir = Path(scratch)
        nodes = TwoNodes(workdir / "nodes")
        nodes.start()
        outcomes: list[tuple[int | None, float, int]] = []
        try:
            for run in range(1, args.runs + 1):
                cwd = workdir / f"run{run}"
                cwd.mkdir()
                cmd = [str(BIN / "python"), "-m", "hvdtrain", "doctor", "-H", "node0:1,node1:1", *args.doctor_args]
                finished = run_with_deadline(cmd, args.limit, nodes.env(cwd), cwd)
                deadline = time.monotonic() + 15  # remote ranks end themselves within seconds
                while left_behind(cwd) and time.monotonic() < deadline:
                    time.sleep(0.5)
                left = left_behind(cwd)
                status = "hung (ended by this script)" if finished.timed_out else f"exit {finished.returncode}"
                print(f"run {run}/{args.runs}: {status} in {finished.seconds:.1f} s"
                      + (f", {len(left)} process(es) left behind: {left}" if left else ""), flush=True)
                if finished.returncode != 0:
                    for line in finished.stderr.strip().splitlines()[-3:]:
                        print(f"    {line}")
                outcomes.append((finished.returncode, finished.seconds, len(left)))
        finally:
            nodes.stop()

    ok = [seconds for code, seconds, _ in outcomes if code == 0]
    seconds = [s for _, s, _ in outcomes]
    summary = f"finished {len(ok)}/{len(outcomes)}, median {statistics.median(seconds):.0f} s, max {max(seconds):.0f} s"
    hung = sum(code is None for code, _, _ in outcomes)
    left = sum(n for _, _, n in outcomes)
    print(f"{summary}; hung {hung}, processes left behind {left}")
    return 0 if len(ok) == len(outcomes) and not left else 1


if __name__ == "__main__":
    sys.exit(main())
