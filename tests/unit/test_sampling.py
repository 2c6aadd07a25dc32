import itertools

import pytest

from hvdtrain.data import ShardedSampler


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("num_samples", [1, 7, 10, 50, 101])
def test_val_shards_cover_every_index_exactly_once(world_size, num_samples):
    shards = [list(ShardedSampler(num_samples, world_size, rank, shuffle=False, pad=False))
              for rank in range(world_size)]
    seen = sorted(itertools.chain.from_iterable(shards))
    assert seen == list(range(num_samples))
    assert [len(s) for s in shards] == [len(ShardedSampler(num_samples, world_size, r, pad=False))
                                        for r in range(world_size)]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_train_shards_are_equal_length_and_cover_everything(world_size):
    num_samples = 103
    shards = [list(ShardedSampler(num_samples, world_size, rank, seed=3)) for rank in range(world_size)]
    assert len({len(s) for s in shards}) == 1
    assert set(itertools.chain.from_iterable(shards)) == set(range(num_samples))


@pytest.mark.parametrize("world_size", [2, 4])
def test_global_batches_do_not_depend_on_world_size(world_size):
    batch, num_samples = 4, 64
    single = list(ShardedSampler(num_samples, 1, 0, seed=11))
    shards = [list(ShardedSampler(num_samples, world_size, rank, seed=11)) for rank in range(world_size)]
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
