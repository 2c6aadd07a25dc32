"""The sampler without Python lists: the same order, bit for bit, as the list-based
sampler it replaced, and the same augmentation seeds, computed in bulk."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from hvdtrain.data.sampler import ShardedSampler, sample_seed, sample_seeds


class ListSampler:
    """The list-based implementation the sampler had before, kept as the reference."""

    def __init__(self, num_samples, num_replicas, rank, seed=0, shuffle=True, pad=True):
        self.num_samples_total, self.num_replicas, self.rank = num_samples, num_replicas, rank
        self.seed, self.shuffle, self.pad, self.epoch, self.start = seed, shuffle, pad, 0, 0

    def set_epoch(self, epoch, start=0):
        self.epoch, self.start = epoch, start

    def global_order(self):
        if not self.shuffle:
            return list(range(self.num_samples_total))
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_samples_total, generator=generator).tolist()

    def indices(self):
        order = self.global_order()
        rest = order[self.start:]
        if self.pad and order:
            short = -len(rest) % self.num_replicas
            rest = rest + (order * (short // len(order) + 1))[:short]
        return rest[self.rank::self.num_replicas]

    def __iter__(self):
        return iter([(index, sample_seed(self.seed, self.epoch, index)) for index in self.indices()])


@pytest.mark.parametrize("num_samples", [0, 1, 2, 5, 7, 64, 101, 1000])
@pytest.mark.parametrize("replicas", [1, 2, 3, 8])
@pytest.mark.parametrize("shuffle, pad", [(True, True), (True, False), (False, True), (False, False)])
def test_the_order_is_the_list_based_one(num_samples, replicas, shuffle, pad):
    starts = sorted({0, 1, replicas, num_samples // 2, max(0, num_samples - 1), num_samples, num_samples + 3})
    for rank, start, epoch in itertools.product(range(replicas), starts, (0, 3)):
        ours, reference = (cls(num_samples, replicas, rank, seed=7, shuffle=shuffle, pad=pad)
                           for cls in (ShardedSampler, ListSampler))
        ours.set_epoch(epoch, start)
        reference.set_epoch(epoch, start)
        expected = reference.indices()
        assert ours.indices() == expected and ours.index_array().tolist() == expected
        assert ours.index_array().dtype == np.int64
        assert list(ours) == list(reference)
        assert len(ours) == len(expected)
        assert ours.global_order().tolist() == reference.global_order()


def test_a_large_order_is_the_list_based_one():
    for rank in (0, 5):
        ours, reference = ShardedSampler(300_007, 8, rank, seed=3), ListSampler(300_007, 8, rank, seed=3)
        ours.set_epoch(2, start=1234)
        reference.set_epoch(2, start=1234)
        assert list(ours) == list(reference)


@pytest.mark.parametrize("num_samples", [1, 10, 1000, 1_281_167])
def test_randperm_draws_the_same_permutation_in_int32(num_samples):
    first, second = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
    assert torch.equal(torch.randperm(num_samples, generator=first),
                       torch.randperm(num_samples, generator=second, dtype=torch.int32).long())


def test_bulk_seeds_are_the_scalar_ones():
    rng = np.random.default_rng(0)
    indices = np.concatenate([np.arange(50), rng.integers(0, 2**40, 200), [2**62, 2**63 - 1]]).astype(np.int64)
    for seed, epoch in [(0, 0), (1, 0), (42, 89), (2**31 - 1, 5), (2**63, 1), (-3, 2), (12345678901234567890, 7)]:
        bulk = sample_seeds(seed, epoch, indices)
        assert bulk.dtype == np.int64 and (bulk >= 0).all()
        assert bulk.tolist() == [sample_seed(seed, epoch, int(i)) for i in indices]


def test_iteration_yields_python_ints_lazily_with_the_resolution():
    sampler = ShardedSampler(10_000, 2, 1, seed=1, resolution=lambda epoch: 160 + 16 * epoch)
    sampler.set_epoch(2)
    samples = iter(sampler)
    sampler.set_epoch(3)  # the order was drawn when iteration began
    first = next(samples)
    assert all(type(value) is int for value in first) and first[2] == 192
    rest = list(samples)
    assert len(rest) + 1 == len(sampler) == 5000
    reference = ListSampler(10_000, 2, 1, seed=1)
    reference.set_epoch(2)
    assert [first[:2]] + [pair[:2] for pair in rest] == list(reference)
