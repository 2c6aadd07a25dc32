"""Step phases, their fractions and the straggler rule (observe/phases.py), on a clock the test drives."""

from __future__ import annotations

import pytest

from hvdtrain.observe import phases
from hvdtrain.observe.phases import StepClock, epoch_phases, find_stragglers, straggler_line


class FakeTime:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock_time(monkeypatch) -> FakeTime:
    fake = FakeTime()
    monkeypatch.setattr(phases.time, "perf_counter", fake)
    return fake


def run_step(clock: StepClock, now: FakeTime, seconds: dict[str, float], passes: int = 1) -> None:
    """One step as the engine laps it: other (stop check, lr), then data/compute per pass,
    allreduce wait, optimizer, and the rest (callbacks) at the end."""
    clock.begin()
    now.now += seconds.get("other", 0.0)
    clock.lap("other")
    for _ in range(passes):
        now.now += seconds["data"] / passes
        clock.lap("data")
        now.now += seconds["compute"] / passes
        clock.lap("compute")
    now.now += seconds["allreduce"]
    clock.lap("allreduce")
    now.now += seconds["optimizer"]
    clock.lap("optimizer")
    now.now += seconds.get("after", 0.0)
    clock.end()


def test_clock_splits_each_step_into_its_phases(clock_time):
    clock = StepClock()
    for _ in range(4):
        run_step(clock, clock_time, {"other": 0.01, "data": 0.1, "compute": 0.5, "allreduce": 0.2,
                                     "optimizer": 0.05, "after": 0.04}, passes=2)
    summary = clock.summary()
    assert summary["steps"] == 4
    expected = {"data": 0.1, "compute": 0.5, "allreduce": 0.2, "optimizer": 0.05, "other": 0.05}
    for phase, seconds in expected.items():
        assert summary[phase] == pytest.approx(seconds), phase
    assert phases.fractions(summary) == pytest.approx({k: v / 0.9 for k, v in expected.items()})
    assert phases.busy(summary) == pytest.approx(0.65)


def test_gpu_clock_times_one_step_in_every_and_waits_only_then(clock_time):
    waits = []
    clock = StepClock(wait=lambda: waits.append(clock_time.now), every=10)
    for step in range(25):  # steps 0, 10 and 20 are timed
        run_step(clock, clock_time, {"data": 0.1 * (step + 1), "compute": 1.0, "allreduce": 0.0, "optimizer": 0.0})
    summary = clock.summary()
    assert summary["steps"] == 3
    assert summary["data"] == pytest.approx((0.1 + 1.1 + 2.1) / 3)
    assert len(waits) == 3 * 7  # begin + 5 laps + the end's lap, on timed steps only


def test_disabled_clock_times_nothing(clock_time):
    clock = StepClock(enabled=False)
    run_step(clock, clock_time, {"data": 1, "compute": 1, "allreduce": 1, "optimizer": 1})
    assert clock.summary()["steps"] == 0


def rank(number: int, data: float, compute: float = 0.5, allreduce: float = 0.1, optimizer: float = 0.05,
         host: str = "node0") -> dict:
    return {"rank": number, "host": host, "steps": 10.0, "data": data, "compute": compute,
            "allreduce": allreduce, "optimizer": optimizer, "other": 0.0}


def test_epoch_figures_average_fractions_over_ranks():
    figures = epoch_phases([rank(0, 0.0, 0.5, 0.5, 0.0), rank(1, 0.5, 0.5, 0.0, 0.0)])
    assert figures["phase_data"] == pytest.approx(0.25)
    assert figures["phase_compute"] == pytest.approx(0.5)
    assert figures["phase_allreduce"] == pytest.approx(0.25)
    assert figures["busy_ms_per_step"] == pytest.approx(750.0)  # median of 500 and 1000
    assert [r["busy_ms_per_step"] for r in figures["by_rank"]] == [500.0, 1000.0]
    assert epoch_phases([{**rank(0, 0.1), "steps": 0.0}]) == {}


def test_a_slow_rank_is_named_with_its_host_and_the_phase_that_makes_it_slow():
    ranks = [rank(0, 0.05), rank(1, 0.05), rank(2, 0.40, host="node1"), rank(3, 0.06)]
    found = find_stragglers(ranks, threshold=0.15)
    assert [(s["rank"], s["host"], s["phase"]) for s in found] == [(2, "node1", "data")]
    # busy: 0.95 s against a median of (0.60 + 0.61) / 2 = 0.605 s
    assert found[0]["slower"] == pytest.approx(0.95 / 0.605 - 1, abs=1e-4)
    assert straggler_line(found[0]) == ("hvdtrain: straggler: rank 2 on node1 is 57% slower than the median rank: "
                                        "data wait 38% of its step")
    # Waiting in the allreduce is not being slow: the fast ranks wait for the slow one.
    assert find_stragglers([rank(0, 0.05, allreduce=2.0), rank(1, 0.05), rank(2, 0.05)], 0.15) == []
    assert find_stragglers(ranks, threshold=0) == []          # off
    assert find_stragglers(ranks[:1], threshold=0.15) == []   # one rank: nobody to compare with
    # Named for the phase above the others' (compute here), not for its largest one (data).
    slow_compute = [rank(0, 0.3, 0.2), rank(1, 0.3, 0.2), rank(2, 0.3, 0.5)]
    assert [(s["rank"], s["phase"]) for s in find_stragglers(slow_compute, 0.15)] == [(2, "compute")]
