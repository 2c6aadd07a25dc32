"""runtime.cpu_affinity on real 2-rank launches: every thread of a rank (the training thread,
Horovod's background thread, Gloo's) on that rank's own block of the host's cores, and ranks that
the launcher bound itself left where they are."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time

import pytest

from hvdtrain.launch.placement import split_cores, topology_order
from tests.helpers import BIN, JOB_TIMEOUT, REPO, job_env, launch, launch_command

AFFINITY_PROBE = REPO / "tests" / "parallel" / "affinity_probe.py"
HOST_CORES = sorted(os.sched_getaffinity(0))

pytestmark = pytest.mark.skipif(len(HOST_CORES) < 2, reason="needs 2 cores: one for each rank")


def rank_lines(output: str) -> list[dict]:
    found = [json.loads(line[line.index("{"):]) for line in output.splitlines() if '{"rank"' in line]
    return sorted(found, key=lambda line: line["rank"])


def thread_cores(line: dict) -> set[tuple[int, ...]]:
    return {tuple(cores) for cores in line["threads"].values()}


@pytest.mark.parametrize("kind", ["horovodrun-gloo", "mpirun"])
def test_each_rank_binds_every_thread_to_its_own_cores(kind, tmp_path):
    # rank, not auto: auto leaves binding off while another job's ranks are bound here (a test
    # running beside this one), see the test below
    result = launch(kind, 2, [str(AFFINITY_PROBE), "runtime.cpu_affinity=rank"], tmp_path)
    ranks = rank_lines(result.stdout)
    assert [line["rank"] for line in ranks] == [0, 1], result.stdout
    blocks = []
    for line in ranks:
        assert len(line["threads"]) >= 3, line  # Horovod's threads were running before the binding
        (block,) = thread_cores(line)  # one set for every thread
        assert line["torch_threads"] == len(block)
        blocks.append(block)
    order = topology_order(HOST_CORES)  # whole physical cores together (hvdtrain/launch/placement.py)
    assert blocks == [tuple(sorted(split_cores(order, rank, 2))) for rank in (0, 1)]
    assert set(blocks[0]).isdisjoint(blocks[1]) and sorted(blocks[0] + blocks[1]) == HOST_CORES
    assert f"threads/rank on its own {len(blocks[0])} of the host's cores, malloc tuned" in result.stdout


def test_ranks_bound_by_the_launcher_or_with_affinity_none_stay_where_they_were(tmp_path):
    # mpirun's own binding: each rank on one core already, different on each; hvdtrain leaves them.
    command = ["mpirun", "-np", "2", "--oversubscribe", "-bind-to", "core", "-map-by", "core",
               str(BIN / "python"), str(AFFINITY_PROBE)]
    result = subprocess.run(command, cwd=tmp_path, env=job_env(tmp_path), capture_output=True, text=True,
                            timeout=JOB_TIMEOUT)
    assert result.returncode == 0, result.stdout + result.stderr
    bound = [thread_cores(line) for line in rank_lines(result.stdout)]
    assert len(bound) == 2 and all(len(cores) == 1 for cores in bound) and bound[0] != bound[1], bound
    assert "of the host's cores" not in result.stdout
    # runtime.cpu_affinity=none: every thread may run on every core, as launched.
    result = launch("horovodrun-gloo", 2, [str(AFFINITY_PROBE), "runtime.cpu_affinity=none"], tmp_path)
    assert [thread_cores(line) for line in rank_lines(result.stdout)] == [{tuple(HOST_CORES)}] * 2


def test_a_second_job_on_the_host_never_binds_to_the_cores_of_the_first(tmp_path):
    """Two horovodrun jobs on one host, outside cgroups: both used to bind their ranks to
    the same cores. The first job here binds all of them (rank); the second, on auto, sees the first
    one's ranks bound there, says so in one line and leaves its threads unbound."""
    release = tmp_path / "release"
    first_dir, second_dir = tmp_path / "first", tmp_path / "second"
    first_dir.mkdir()
    second_dir.mkdir()
    first = subprocess.Popen(launch_command("horovodrun-gloo", 2, [str(AFFINITY_PROBE), "runtime.cpu_affinity=rank"]),
                             cwd=first_dir, env={**job_env(first_dir), "AFFINITY_PROBE_HOLD": str(release)},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(first.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + JOB_TIMEOUT
        while len(rank_lines("".join(lines))) < 2 and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        first_ranks = rank_lines("".join(lines))
        assert len(first_ranks) == 2, "".join(lines)[-3000:]
        assert all(len(thread_cores(line)) == 1 for line in first_ranks)  # bound, each rank to one block
        second = launch("horovodrun-gloo", 2, [str(AFFINITY_PROBE)], second_dir)
    finally:
        release.touch()
        first.wait(timeout=JOB_TIMEOUT)
        reader.join(timeout=10)
    assert first.returncode == 0, "".join(lines)[-3000:]
    second_ranks = rank_lines(second.stdout)
    assert [line["rank"] for line in second_ranks] == [0, 1], second.stdout
    for line in second_ranks:
        # no thread of the second job is bound to a block of the first job's cores
        assert thread_cores(line) == {tuple(HOST_CORES)}, line
    off = [text for text in second.stdout.splitlines() if "CPU binding off" in text]
    assert len(off) == 1 and "other processes on this host are bound to CPUs" in off[0], second.stdout
    assert "of the host's cores" not in second.stdout
