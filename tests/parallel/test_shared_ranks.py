"""The suite's shared launched ranks (tests/shared_ranks) stand for a fresh launch: the same job run
on them and launched for real ends with bitwise the same parameters and the same records, and a bad
config gives the same exit code and one-line error. Every test that runs on them relies on this."""

from __future__ import annotations

import pytest

from tests import shared_ranks
from tests.helpers import PROBE, assert_bitwise_equal, final_states, launch, read_metrics, tiny

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
