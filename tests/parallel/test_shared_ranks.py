"""The suite's shared launched ranks (tests/shared_ranks) stand for a fresh launch: the same job run
on them and launched for real ends with bitwise the same parameters and the same records, and a bad
config gives the same exit code and one-line error. Every test that runs on them relies on this."""

from __future__ import annotations

import json

import pytest

from tests import shared_ranks
from tests.helpers import PROBE, REPO, assert_bitwise_equal, final_states, launch, read_metrics, tiny

STATE_PROBE = REPO / "tests" / "parallel" / "process_state_probe.py"

TIMING = {"samples_per_sec", "seconds", "busy_ms_per_step", "by_rank", "cpu_percent", "rss_gib", "stragglers"}


def comparable(records: list[dict]) -> list[dict]:
    """A record without what depends on the clock or the machine's load."""
    return [{k: v for k, v in r.items()
             if k not in TIMING and not k.startswith(("phase_", "workers_", "data_", "straggler"))} for r in records]


@pytest.mark.parametrize("kind", ["horovodrun-gloo", "mpirun"])
def test_a_job_on_the_shared_ranks_ends_as_a_fresh_launch_does(kind, tiny_data, tmp_path):
    if not shared_ranks.enabled():
        pytest.skip("HVDTRAIN_TEST_SHARED_RANKS=0: every job is launched for real")
    results = {}
    for name, own in (("shared", False), ("fresh", True)):
        result = launch(kind, 2, [str(PROBE), str(tmp_path / name)] + tiny(tiny_data, tmp_path / f"run_{name}"),
                        tmp_path, own_launch=own)
        results[name] = result
        states = final_states(tmp_path / name)
        assert_bitwise_equal(states[0], states[1])
    assert results["shared"].args[0].startswith("<shared"), results["shared"].args
    assert not results["fresh"].args[0].startswith("<shared")
    assert_bitwise_equal(final_states(tmp_path / "shared")[0], final_states(tmp_path / "fresh")[0])
    assert comparable(read_metrics(tmp_path / "run_shared")) == comparable(read_metrics(tmp_path / "run_fresh"))


def test_a_bad_config_fails_alike_on_the_shared_ranks_and_in_a_fresh_launch(tiny_data, tmp_path):
    program = ["-m", "hvdtrain"] + tiny(tiny_data, tmp_path / "run", "train.epochs=abc")
    shared = launch("horovodrun-gloo", 2, program, tmp_path, check=False)
    fresh = launch("horovodrun-gloo", 2, program, tmp_path, check=False, own_launch=True)
    assert shared.returncode == fresh.returncode == 1  # horovodrun's own code for a failed rank
    line = "[0]<stderr>:hvdtrain: error: config key 'train.epochs' expects int, got 'abc'"
    assert line in shared.stderr.splitlines() and line in fresh.stderr


def described(folder) -> list[dict]:
    return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def test_a_job_after_one_that_changed_process_wide_state_finds_a_fresh_process(tiny_data, tmp_path):
    """A job that leaves the most process-wide state behind (AMP, a loader worker, one thread, then a
    script that changes every entry of tests/shared_ranks/process_state.py), then a default job: on
    the shared ranks, it finds what a fresh process finds and ends bitwise as in a fresh launch."""
    if not shared_ranks.enabled():
        pytest.skip("HVDTRAIN_TEST_SHARED_RANKS=0: every job is launched for real")
    kind = "horovodrun-gloo"
    messy = launch(kind, 2, ["-m", "hvdtrain"] + tiny(tiny_data, tmp_path / "messy", "amp.enabled=true",
                                                      "amp.dtype=bfloat16", "data.workers=1", "runtime.threads=1",
                                                      "train.epochs=1"), tmp_path)
    dirty = launch(kind, 2, [str(STATE_PROBE), str(tmp_path / "dirty"), "--dirty"], tmp_path)
    after = launch(kind, 2, [str(STATE_PROBE), str(tmp_path / "after")], tmp_path)
    fresh = launch(kind, 2, [str(STATE_PROBE), str(tmp_path / "fresh")], tmp_path, own_launch=True)
    assert all(r.args[0].startswith("<shared") for r in (messy, dirty, after)), [r.args for r in (messy, dirty, after)]
    assert not fresh.args[0].startswith("<shared")
    found, expected = described(tmp_path / "after"), described(tmp_path / "fresh")
    assert found == expected, [{k: (a[k], b[k]) for k in a if a[k] != b[k]} for a, b in zip(found, expected)]
    # Every entry was changed by the dirty job: each one is equal again because it was put back.
    assert all(value != expected[0][name] for name, value in described(tmp_path / "dirty")[0].items())

    for name, own in (("shared", False), ("fresh", True)):
        launch(kind, 2, [str(PROBE), str(tmp_path / name)] + tiny(tiny_data, tmp_path / f"run_{name}"), tmp_path,
               own_launch=own)
    assert_bitwise_equal(final_states(tmp_path / "shared")[0], final_states(tmp_path / "fresh")[0])
    assert comparable(read_metrics(tmp_path / "run_shared")) == comparable(read_metrics(tmp_path / "run_fresh"))
