"""The ranks' agreement on a stop, waited for at a boundary or read at a later one
(preemption.StopRequest.agreed): two ranks simulated in one process, over a fake allreduce that
sums what both sent as their n-th operation, and a fake clock for the time between boundaries."""

from __future__ import annotations

import signal

import pytest
import torch

from hvdtrain.comm import dist, horovod_engine
from hvdtrain.fault import preemption
from hvdtrain.fault.preemption import StopRequest


class TwoRanks:
    """A fake Horovod for two ranks taking turns: the n-th operation a rank sends is summed with
    the other rank's n-th, and reading it before both sent it is an error (a hang in real life)."""

    def __init__(self, monkeypatch):
        self.current = 0
        self.sent: list[list[torch.Tensor]] = [[], []]
        self.blocking_calls = 0
        monkeypatch.setattr(dist, "allreduce_sum_async", self.send)
        monkeypatch.setattr(dist, "wait", self.read)
        monkeypatch.setattr(dist, "allreduce_sum", self.blocking)

    def send(self, tensor, name):
        self.sent[self.current].append(tensor.clone())
        return (self.current, len(self.sent[self.current]) - 1)

    def read(self, handle):
        _, index = handle
        assert all(len(sent) > index for sent in self.sent), "read before every rank sent it: a hang"
        return self.sent[0][index] + self.sent[1][index]

    def blocking(self, tensor, name=None):
        self.blocking_calls += 1
        return self.read(self.send(tensor, name))


def every_step() -> StopRequest:
    """An agreement at every boundary, read at the next (what steps of interval_seconds or more get)."""
    stop = StopRequest()
    stop.interval_seconds = 0.0
    return stop


class Clock:
    """time.perf_counter for preemption, moved on by the test."""

    def __init__(self, monkeypatch):
        self.now = 100.0
        monkeypatch.setattr(preemption.time, "perf_counter", lambda: self.now)


def boundary(ranks: TwoRanks, stops: list[StopRequest], wait: bool) -> list[bool]:
    """Both ranks at one step boundary; the second rank's blocking send completes the first's."""
    if not wait:
        answers = []
        for rank, stop in enumerate(stops):
            ranks.current = rank
            answers.append(stop.agreed(wait=False))
        return answers
    # A blocking agreement: both send, then both read (what a real allreduce does concurrently).
    handles = []
    for rank, stop in enumerate(stops):
        ranks.current = rank
        if stop.settle():
            handles.append(None)
            continue
        handles.append(ranks.send(stop.local(), "x"))
    return [handle is None or bool(ranks.read(handle).sum() > 0) for handle in handles]


def test_a_signal_on_one_rank_stops_both_at_the_same_boundary_one_later_than_a_wait_would(monkeypatch):
    ranks = TwoRanks(monkeypatch)
    stops = [every_step(), every_step()]
    assert boundary(ranks, stops, wait=False) == [False, False]  # nothing in flight yet
    assert boundary(ranks, stops, wait=False) == [False, False]
    stops[1].received = signal.SIGTERM  # during the next step, on rank 1 only
    assert boundary(ranks, stops, wait=False) == [False, False]  # sent now, read at the next boundary
    assert boundary(ranks, stops, wait=False) == [True, True]
    assert all(stop.in_flight is None for stop in stops)  # a stop sends nothing more
    assert [stop.reason() for stop in stops] == ["a stop signal sent to another rank", "SIGTERM"]
    assert ranks.blocking_calls == 0


def test_settle_reads_what_is_in_flight_and_a_waiting_agreement_reads_it_first(monkeypatch):
    ranks = TwoRanks(monkeypatch)
    stops = [every_step(), every_step()]
    boundary(ranks, stops, wait=False)
    stops[0].received = signal.SIGUSR1
    boundary(ranks, stops, wait=False)  # rank 0's stop is in flight
    for rank, stop in enumerate(stops):  # the end of the epoch's steps
        ranks.current = rank
        assert stop.settle() is True
        assert stop.in_flight is None and stop.settle() is False
    # The signal stays recorded: the next epoch's first (waiting) boundary agrees on it again.
    ranks.current = 0
    assert boundary(ranks, stops, wait=True) == [True, True]


def test_counts_that_must_be_judged_before_the_step_refuse_to_wait_a_step(monkeypatch):
    TwoRanks(monkeypatch)
    with pytest.raises(AssertionError, match="cannot wait a step"):
        StopRequest().agreed(extra=torch.zeros(3), wait=False)


def test_a_waiting_agreement_with_an_answer_in_flight_that_says_stop_sends_nothing_more(monkeypatch):
    ranks = TwoRanks(monkeypatch)
    stop = StopRequest()
    ranks.current = 0
    stop.received = signal.SIGTERM
    stop.agreed(wait=False)
    ranks.current = 1
    StopRequest().agreed(wait=False)  # the other rank's part of the answer in flight
    ranks.current = 0
    assert stop.agreed() is True
    assert ranks.blocking_calls == 0 and len(ranks.sent[0]) == 1


def test_fast_steps_agree_every_half_second_of_steps_and_a_stop_is_still_seen_by_both_at_once(monkeypatch):
    """Steps of 10 ms on one rank and 30 ms on the other: the ranks time the steps between two
    agreements, sum those times in the agreement itself and compute the same interval, 0.5 s / 20 ms
    = 25 boundaries; nothing is sent in between, and a signal on one rank still stops both at the
    same boundary."""
    ranks, clock = TwoRanks(monkeypatch), Clock(monkeypatch)
    stops = [StopRequest(), StopRequest()]
    step_seconds = [0.010, 0.030]

    def steps(count: int) -> list[list[bool]]:
        answers = []
        for _ in range(count):
            answers.append([])
            for rank, stop in enumerate(stops):  # both at the same boundary, each after its own step
                ranks.current = rank
                clock.now += step_seconds[rank] / 2  # the fake clock is shared: half each
                answers[-1].append(stop.agreed(wait=False))
        return answers

    steps(3)  # sent untimed at the first; read and sent timed at the second; read at the third
    assert [stop.every for stop in stops] == [25, 25]
    sent = len(ranks.sent[0])
    assert steps(24) == [[False, False]] * 24 and len(ranks.sent[0]) == sent  # no round in between
    assert steps(1) == [[False, False]] and len(ranks.sent[0]) == sent + 1   # the 25th boundary
    stops[0].received = signal.SIGTERM
    answers = steps(60)
    first = answers.index([True, True])
    assert answers[:first] == [[False, False]] * first and 24 <= first <= 49  # within two intervals
    assert stops[1].reason() == "a stop signal sent to another rank"


def test_the_interval_follows_the_steps_speed_and_never_exceeds_its_bounds(monkeypatch):
    ranks, clock = TwoRanks(monkeypatch), Clock(monkeypatch)
    stops = [StopRequest(), StopRequest()]

    def run(step_seconds: float, count: int) -> list[int]:
        for _ in range(count):
            for rank, stop in enumerate(stops):
                ranks.current = rank
                clock.now += step_seconds / 2
                stop.agreed(wait=False)
        return [stop.every for stop in stops]

    assert run(2.0, 3) == [1, 1]        # steps longer than the interval: every boundary, as before
    assert run(0.1, 6) == [5, 5]        # the next read measures the faster steps
    assert run(0.0, 20) == [preemption.MOST_BOUNDARIES_BETWEEN] * 2  # a clock that does not move (read twice)
    for stop in stops:  # the end of an epoch's steps, and a long validation
        ranks.current = stops.index(stop)
        stop.settle()
    clock.now += 60.0
    run(0.1, 1)  # the first send of an epoch is untimed: the 60 s between epochs do not count
    for rank, stop in enumerate(stops):
        ranks.current = rank
        stop.settle()  # timed, 60 s for one boundary would have made it every boundary
    assert [stop.every for stop in stops] == [preemption.MOST_BOUNDARIES_BETWEEN] * 2


def test_a_quiet_wait_naps_while_it_is_short_and_leaves_a_long_one_to_horovod(monkeypatch):
    """dist.wait_quietly looks every 0.1 ms until the operations are done, but for at most
    QUIET_POLL_LIMIT_SECONDS in all: the caller's hvd.synchronize, which sleeps on a condition
    variable (Horovod patch 0002), waits for the rest, so a late rank costs no CPU."""
    looks = {7: 0, 8: 0}

    def poll(handle):
        looks[handle] += 1
        return handle == 7 and looks[handle] >= 3  # 7 finishes at its third look, 8 never

    clock = {"now": 0.0, "naps": []}

    def nap(seconds):  # a fake clock: each nap takes 15 ms
        clock["naps"].append(seconds)
        clock["now"] += 0.015

    monkeypatch.setattr(horovod_engine.hvd, "poll", poll)
    monkeypatch.setattr(horovod_engine.time, "sleep", nap)
    monkeypatch.setattr(horovod_engine.time, "perf_counter", lambda: clock["now"])
    horovod_engine.wait_quietly(iter([7, None, 8]))
    assert looks[7] == 3
    # 8 was looked at until the 50 ms were spent (the 2 naps for 7 count: 30 ms), then left to Horovod
    assert clock["naps"] == [horovod_engine.QUIET_POLL_SECONDS] * 4 and looks[8] == 3


def test_the_stop_names_the_first_signal_and_ctrl_c_is_sigint():
    stop = StopRequest()
    stop._handler(signal.SIGINT, None)
    stop._handler(signal.SIGTERM, None)  # horovodrun or mpirun ending the job after the Ctrl-C
    assert stop.reason() == "SIGINT (Ctrl-C)"
    with pytest.raises(KeyboardInterrupt):  # a second Ctrl-C does not wait for the checkpoint
        stop._handler(signal.SIGINT, None)
    term = StopRequest()
    term._handler(signal.SIGTERM, None)
    term._handler(signal.SIGINT, None)
    assert term.reason() == "SIGTERM"


def test_ctrl_c_is_kept_during_start_up_and_while_training():
    stop = StopRequest()
    before = signal.getsignal(signal.SIGINT)
    stop.keep_early()
    try:
        assert signal.getsignal(signal.SIGINT) == stop._handler
        with stop.installed():
            signal.raise_signal(signal.SIGINT)  # no KeyboardInterrupt: recorded, stopped at a boundary
            assert stop.received == signal.SIGINT
    finally:
        stop.release_early()
    assert signal.getsignal(signal.SIGINT) is before
