"""Shares drawn ahead on a thread, from set_epoch and for the next epoch while one runs:
the same array as a draw in the caller's thread whatever the timing (a draw slower than the epoch,
a resume elsewhere, a failed draw, a copy of the sampler), drawn once per epoch and position, and
no thread left behind."""

from __future__ import annotations

import copy
import os
import pickle
import threading
import time

import pytest

from hvdtrain.data import sampler as sampler_module
from hvdtrain.data.sampler import ShardedSampler
from tests.unit.test_sampler_scale import ListSampler


class Draws:
    """Wraps ``epoch_order``: records (thread name, epoch) of every draw; can slow draws on a
    thread down, or make the next one there fail."""

    def __init__(self, monkeypatch, delay: float = 0.0):
        self.calls: list[tuple[str, int]] = []
        self.delay, self.fail_next = delay, False
        self.original = sampler_module.epoch_order
        monkeypatch.setattr(sampler_module, "epoch_order", self)
        monkeypatch.setattr(sampler_module, "PREFETCH_MIN_SAMPLES", 0)

    def __call__(self, num_samples, seed, epoch, shuffle=True):
        name = threading.current_thread().name
        self.calls.append((name, epoch))
        if name != "MainThread":
            time.sleep(self.delay)
            if self.fail_next:
                self.fail_next = False
                raise MemoryError("a draw on its thread failed")
        return self.original(num_samples, seed, epoch, shuffle)

    def on_main(self) -> list[int]:
        return [epoch for name, epoch in self.calls if name == "MainThread"]


def reference(num_samples, replicas, rank, epoch, start=0, seed=7):
    sampler = ListSampler(num_samples, replicas, rank, seed=seed)
    sampler.set_epoch(epoch, start)
    return list(sampler)


def sampler_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("hvdtrain-sampler")]


def no_thread_left(timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while sampler_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    return not sampler_threads()


@pytest.mark.parametrize("replicas, rank", [(1, 0), (3, 2), (8, 5)])
def test_every_epoch_is_drawn_ahead_once_and_is_the_same_order(monkeypatch, replicas, rank):
    draws = Draws(monkeypatch)
    sampler = ShardedSampler(1001, replicas, rank, seed=7)
    for epoch in range(4):
        sampler.set_epoch(epoch)
        assert list(sampler) == reference(1001, replicas, rank, epoch)
    # The first epoch from set_epoch, each later one while the epoch before it ran; the caller's
    # thread drew none, and no epoch was drawn twice.
    assert no_thread_left()
    assert draws.on_main() == []
    assert [epoch for _, epoch in draws.calls] == [0, 1, 2, 3, 4]


def test_a_sampler_iterated_without_set_epoch_draws_in_the_callers_thread(monkeypatch):
    draws = Draws(monkeypatch)
    sampler = ShardedSampler(1001, 2, 1, seed=7)
    assert list(sampler) == reference(1001, 2, 1, 0)
    assert no_thread_left()
    assert draws.on_main() == [0] and [epoch for _, epoch in draws.calls] == [0, 1]


@pytest.mark.parametrize("delay", [0.0, 0.1])
def test_the_order_does_not_depend_on_when_the_draw_ends(monkeypatch, delay):
    draws = Draws(monkeypatch, delay=delay)
    sampler = ShardedSampler(999, 4, 1, seed=7)
    sampler.set_epoch(2)
    assert list(sampler) == reference(999, 4, 1, 2)
    # The next epoch is asked for while its draw may still be running (delay): it waits for it.
    sampler.set_epoch(3)
    assert list(sampler) == reference(999, 4, 1, 3)
    # A resume at another position of the epoch that was drawn ahead (4, 0): drawn anew.
    sampler.set_epoch(4, start=37)
    assert list(sampler) == reference(999, 4, 1, 4, start=37)
    # Positions set one after the other before any is taken: the last one counts.
    sampler.set_epoch(9, start=5)
    sampler.set_epoch(9, start=6)
    assert list(sampler) == reference(999, 4, 1, 9, start=6)
    # The seed changes after set_epoch (the key has it): drawn in this thread.
    sampler.set_epoch(10)
    sampler.seed = 8
    assert list(sampler) == reference(999, 4, 1, 10, seed=8)
    assert no_thread_left()
    assert draws.on_main() == [10]
    # Each draw once: (2, 0) (3, 0) (4, 0) (4, 37) (5, 0) (9, 5) (9, 6) (10, 0) (10, 0 with seed 8) (11, 0).
    assert [epoch for _, epoch in draws.calls] == [2, 3, 4, 4, 5, 9, 9, 10, 10, 11]


def test_a_failed_draw_is_drawn_again_in_the_callers_thread(monkeypatch):
    draws = Draws(monkeypatch)
    draws.fail_next = True
    sampler = ShardedSampler(500, 2, 0, seed=7)
    sampler.set_epoch(0)  # its draw on the thread raises MemoryError
    assert list(sampler) == reference(500, 2, 0, 0)
    sampler.set_epoch(1)
    assert list(sampler) == reference(500, 2, 0, 1)
    assert draws.on_main() == [0]
    assert no_thread_left()


def test_a_second_caller_of_the_same_epoch_gets_the_same_array_without_a_draw(monkeypatch):
    # The elastic sample log takes index_array() after set_epoch, then the loader iterates.
    draws = Draws(monkeypatch)
    sampler = ShardedSampler(400, 2, 1, seed=7)
    sampler.set_epoch(3, start=10)
    share = sampler.index_array()
    sampler.set_epoch(3, start=10)
    assert sampler.index_array() is share and [i for i, _ in sampler] == share.tolist()
    assert no_thread_left()
    assert [epoch for _, epoch in draws.calls] == [3, 4]  # this epoch once, the next ahead


def test_a_copy_of_a_sampler_with_a_draw_under_way_draws_its_own(monkeypatch):
    Draws(monkeypatch, delay=0.2)
    sampler = ShardedSampler(300, 3, 2, seed=7)
    sampler.set_epoch(5)
    sampler.index_array()  # epoch 6 is being drawn
    for twin in (pickle.loads(pickle.dumps(sampler)), copy.deepcopy(sampler)):
        twin.set_epoch(6)
        assert list(twin) == reference(300, 3, 2, 6)
    sampler.set_epoch(6)
    assert list(sampler) == reference(300, 3, 2, 6)
    assert no_thread_left()


def test_no_os_thread_is_left_by_the_draws():
    # Large enough to be drawn ahead (PREFETCH_MIN_SAMPLES) without patching: randperm's parallel
    # fill starts OpenMP threads from each draw's thread; they must end with it. The references
    # are drawn first: their randperm starts this thread's own OpenMP threads, which stay.
    expected = {epoch: reference_indices(epoch) for epoch in range(6)}
    sampler = ShardedSampler(300_007, 8, 3, seed=1)
    assert sampler.num_samples_total >= sampler_module.PREFETCH_MIN_SAMPLES
    sampler.set_epoch(0)
    assert sampler.index_array().tolist() == expected[0]
    assert no_thread_left()
    tasks = len(os.listdir("/proc/self/task"))
    for epoch in range(1, 6):
        sampler.set_epoch(epoch)
        assert sampler.index_array().tolist() == expected[epoch]
    assert no_thread_left()
    deadline = time.monotonic() + 30  # a thread leaves /proc a moment after Python forgets it
    while len(os.listdir("/proc/self/task")) > tasks and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(os.listdir("/proc/self/task")) <= tasks


def reference_indices(epoch: int) -> list[int]:
    sampler = ListSampler(300_007, 8, 3, seed=1)
    sampler.set_epoch(epoch)
    return sampler.indices()


def static_run(sampler, epoch: int, step_in_epoch: int = 0, epochs: int = 4):
    """What draw_first_epoch reads of a run: its train sampler, position, global batch (16), epochs."""
    from types import SimpleNamespace

    return SimpleNamespace(loaders=SimpleNamespace(train_sampler=sampler), global_batch=16,
                           state=SimpleNamespace(position=SimpleNamespace(epoch=epoch, step_in_epoch=step_in_epoch)),
                           cfg=SimpleNamespace(train=SimpleNamespace(epochs=epochs)))


@pytest.mark.parametrize("epoch, step_in_epoch", [(0, 0), (2, 3)])
def test_the_run_starts_drawing_its_first_epoch_where_it_resumes(monkeypatch, epoch, step_in_epoch):
    # Static.start calls draw_first_epoch right after resume: the share of the run's position is
    # drawn on the thread from then on, and the loop's set_epoch for that position takes it
    # without a second draw (a fresh run, and one resumed at step 3 of epoch 2).
    from hvdtrain.train.trainer import draw_first_epoch

    draws = Draws(monkeypatch, delay=0.05)
    sampler = ShardedSampler(1001, 2, 1, seed=7)
    draw_first_epoch(static_run(sampler, epoch, step_in_epoch))
    assert [t.name for t in sampler_threads()] == [f"hvdtrain-sampler-epoch-{epoch}"]
    sampler.set_epoch(epoch, start=step_in_epoch * 16)
    assert list(sampler) == reference(1001, 2, 1, epoch, start=step_in_epoch * 16)
    assert no_thread_left()
    assert draws.on_main() == [] and [e for _, e in draws.calls] == [epoch, epoch + 1]


def test_a_finished_run_draws_nothing(monkeypatch):
    from hvdtrain.train.trainer import draw_first_epoch

    draws = Draws(monkeypatch)
    draw_first_epoch(static_run(ShardedSampler(1001, 2, 1, seed=7), epoch=4))
    assert not sampler_threads() and draws.calls == []


def test_a_static_run_draws_its_first_epoch_once_resumed(monkeypatch):
    from hvdtrain.train import trainer

    calls = []
    monkeypatch.setattr(trainer, "resume", lambda run: calls.append(("resume", run)))
    monkeypatch.setattr(trainer, "draw_first_epoch", lambda run: calls.append(("draw", run)))
    trainer.Static().start("the run")
    assert calls == [("resume", "the run"), ("draw", "the run")]


def test_a_stream_that_keeps_its_own_position_is_left_to_its_set_epoch():
    # The tar shards' ShardStream (and a task's own stream) is the loaders' train_sampler without
    # being a ShardedSampler: nothing is drawn ahead for it, and nothing else is asked of it.
    from hvdtrain.train.trainer import draw_first_epoch

    class Stream:
        def set_epoch(self, epoch: int, start: int = 0) -> None:
            raise AssertionError("draw_first_epoch called the stream")

    draw_first_epoch(static_run(Stream(), epoch=0))
    assert not sampler_threads()
