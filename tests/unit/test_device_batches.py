"""engine.DeviceBatches: a loader's batches through the task's to_device, never more than the
epoch's count taken from the loader (a batch taken ahead would be read for nothing, or, with
shards, counted in the checkpoint's position); on a CPU each batch is prepared when asked for."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from hvdtrain.train.engine import DeviceBatches, tensors_in


class Task:
    def __init__(self):
        self.calls = 0

    def to_device(self, batch, device, dtype):
        self.calls += 1
        inputs, targets = batch
        return inputs.to(device, dtype), targets.to(device)


def settings(task, prefetch=True):
    return SimpleNamespace(task=task, device=torch.device("cpu"), dtype=torch.float32, prefetch=prefetch)


def test_takes_at_most_count_batches_and_prepares_each_when_asked():
    taken = []

    def loader():
        for index in range(10):
            taken.append(index)
            yield torch.full((2, 3), index, dtype=torch.uint8), torch.tensor([index, index])

    task = Task()
    batches = DeviceBatches(loader(), settings(task), count=4)
    assert taken == [] and task.calls == 0  # nothing is read before it is asked for on a CPU
    first = next(batches)
    assert taken == [0] and first[0].dtype == torch.float32 and first[0][0, 0] == 0
    rest = list(batches)
    assert len(rest) == 3 and taken == [0, 1, 2, 3] and task.calls == 4


def test_without_a_count_every_batch_and_the_tensors_of_nested_inputs():
    task = Task()
    batches = [(torch.zeros(1, 2), torch.zeros(1, dtype=torch.long)) for _ in range(3)]
    assert len(list(DeviceBatches(batches, settings(task, prefetch=False)))) == 3
    nested = ((torch.ones(1), [torch.zeros(2)]), {"a": torch.ones(3)})
    assert [t.numel() for t in tensors_in(nested)] == [1, 2, 3]
