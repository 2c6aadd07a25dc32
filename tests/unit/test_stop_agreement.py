"""The ranks' agreement on a stop, waited for at a boundary or read one boundary later
(preemption.StopRequest.agreed): two ranks simulated in one process, over a fake allreduce that
sums what both sent as their n-th operation."""

from __future__ import annotations

import signal

import pytest
import torch

from hvdtrain.comm import dist
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
        local = torch.tensor([1.0 if stop.received else 0.0, 0.0], dtype=torch.float64)
        handles.append(ranks.send(local, "x"))
    return [handle is None or bool(ranks.read(handle).sum() > 0) for handle in handles]


def test_a_signal_on_one_rank_stops_both_at_the_same_boundary_one_later_than_a_wait_would(monkeypatch):
    ranks = TwoRanks(monkeypatch)
    stops = [StopRequest(), StopRequest()]
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
    stops = [StopRequest(), StopRequest()]
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
