import itertools

import pytest

from hvdtrain.data.sampler import SeededSamples, ShardedSampler, sample_seed


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("num_samples", [1, 7, 10, 50, 101])
def test_val_shards_cover_every_index_exactly_once(world_size, num_samples):
    shards = [ShardedSampler(num_samples, world_size, rank, shuffle=False, pad=False).indices()
              for rank in range(world_size)]
    seen = sorted(itertools.chain.from_iterable(shards))
    assert seen == list(range(num_samples))
    assert [len(s) for s in shards] == [len(ShardedSampler(num_samples, world_size, r, pad=False))
                                        for r in range(world_size)]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_train_shards_are_equal_length_and_cover_everything(world_size):
    num_samples = 103
    shards = [ShardedSampler(num_samples, world_size, rank, seed=3).indices() for rank in range(world_size)]
    assert len({len(s) for s in shards}) == 1
    assert set(itertools.chain.from_iterable(shards)) == set(range(num_samples))


@pytest.mark.parametrize("world_size", [2, 4])
def test_global_batches_do_not_depend_on_world_size(world_size):
    batch, num_samples = 4, 64
    single = ShardedSampler(num_samples, 1, 0, seed=11).indices()
    shards = [ShardedSampler(num_samples, world_size, rank, seed=11).indices() for rank in range(world_size)]
    for k in range(num_samples // (batch * world_size)):
        together = sorted(itertools.chain.from_iterable(s[k * batch:(k + 1) * batch] for s in shards))
        assert together == sorted(single[k * batch * world_size:(k + 1) * batch * world_size])


def test_each_epoch_reshuffles_from_seed_plus_epoch():
    a, b = ShardedSampler(100, 2, 0, seed=1), ShardedSampler(100, 2, 0, seed=1)
    a.set_epoch(3)
    b.set_epoch(3)
    assert list(a) == list(b)
    b.set_epoch(4)
    assert list(a) != list(b)
    c = ShardedSampler(100, 2, 0, seed=2)
    c.set_epoch(3)
    assert list(c) != list(a)


def test_rank_out_of_range():
    with pytest.raises(ValueError):
        ShardedSampler(10, 2, 2)


def test_resume_position_skips_exactly_what_was_consumed():
    sampler = ShardedSampler(50, 2, 1, seed=5)
    sampler.set_epoch(2)
    full = list(sampler)
    sampler.set_epoch(2, start=14)  # 14 samples consumed by 2 ranks = 7 per rank
    assert list(sampler) == full[7:]
    assert len(sampler) == len(full) - 7


@pytest.mark.parametrize("before, after", [(2, 1), (2, 3), (4, 2)])
def test_changing_the_number_of_ranks_mid_epoch_neither_skips_nor_repeats(before, after):
    num_samples, consumed = 60, 24
    first = [ShardedSampler(num_samples, before, r, seed=9).indices() for r in range(before)]
    done = [i for r in range(before) for i in first[r][:consumed // before]]
    rest = []
    for r in range(after):
        sampler = ShardedSampler(num_samples, after, r, seed=9)
        sampler.set_epoch(0, start=consumed)
        rest += sampler.indices()
    assert sorted(done + rest[:num_samples - consumed]) == list(range(num_samples))
    assert len(set(done + rest)) == num_samples


def test_augmentation_seed_depends_on_sample_not_on_rank_or_position():
    one = dict(ShardedSampler(20, 1, 0, seed=4))
    two = dict(pair for rank in range(2) for pair in ShardedSampler(20, 2, rank, seed=4))
    assert one == two
    assert len(set(one.values())) == 20
    assert sample_seed(4, 0, 3) != sample_seed(4, 1, 3)


def test_seeded_samples_are_reproducible_and_leave_global_rng_alone():
    import random

    import torch

    class Noisy(torch.utils.data.Dataset):
        def __len__(self):
            return 3

        def __getitem__(self, index):
            return torch.rand(2), random.random()

    dataset = SeededSamples(Noisy())
    torch.manual_seed(0)
    random.seed(0)
    first = dataset[(1, 123)]
    after = torch.rand(1), random.random()
    torch.manual_seed(0)
    random.seed(0)
    assert torch.equal(dataset[(1, 123)][0], first[0]) and dataset[(1, 123)][1] == first[1]
    assert not torch.equal(dataset[(1, 124)][0], first[0])
    torch.manual_seed(0)
    random.seed(0)
    assert (torch.rand(1), random.random()) == after
