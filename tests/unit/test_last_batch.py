"""train.drop_last=false: the epoch's last partial batch is trained on, as DistributedSampler and
DataLoader's defaults do in pytorch/examples' imagenet/main.py. The order is padded to a multiple of
the ranks, so that every rank's last batch has the same size; validation still counts every sample
once. (tests/parallel/test_last_batch.py checks the steps of 2 launched ranks against SGD by hand.)"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from PIL import Image

from hvdtrain.config import ConfigError
from hvdtrain.data.loaders import Loaders
from hvdtrain.data.sampler import ShardedSampler
from hvdtrain.job_config import load_config
from hvdtrain.tasks import DataEnv
from hvdtrain.tasks.image_classification import ImageClassification
from hvdtrain.train.builders import last_batch_note


def image_folder(root: Path, train: int = 11, val: int = 5) -> Path:
    """root/{train,val}/{a,b}/N.jpg: ``train`` and ``val`` small JPEGs over two classes."""
    for split, count in (("train", train), ("val", val)):
        for number in range(count):
            folder = root / split / "ab"[number % 2]
            folder.mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (12, 10), (number * 20 % 256, 80, 160)).save(folder / f"{number}.jpg")
    return root


def rank_loaders(tmp_path: Path, drop_last: bool, rank: int) -> Loaders:
    images = tmp_path / "images"
    if not images.exists():
        image_folder(images)
    cfg = load_config(None, [f"data.dir={images}", "data.workers=0", "data.index_cache=false", "data.image_size=8",
                             "train.batch_size=4", f"train.drop_last={str(drop_last).lower()}",
                             f"output.dir={tmp_path / 'run'}"])
    # What train/builders.py hands the task.
    env = DataEnv(rank=rank, world_size=2, pin_memory=False, keep_partial_batches=not cfg.train.drop_last)
    return ImageClassification(cfg).build_loaders(env)


def test_the_last_partial_batch_is_kept_padded_to_the_same_size_on_every_rank(tmp_path):
    kept = [rank_loaders(tmp_path, False, rank) for rank in range(2)]
    # 11 images on 2 ranks: 6 each (one wraps around), batches of 4 and 2 on both ranks.
    sizes = [[len(labels) for _, labels in loaders.train] for loaders in kept]
    assert sizes == [[4, 2], [4, 2]] and [len(loaders.train) for loaders in kept] == [2, 2]
    taken = Counter(index for loaders in kept for index in loaders.train_sampler.indices())
    assert sorted(taken) == list(range(11)) and sum(taken.values()) == 12  # every image; one twice
    # Validation: every image once, whatever drop_last says.
    assert sorted(i for loaders in kept for i in loaders.val_sampler.indices()) == list(range(5))
    dropped = [rank_loaders(tmp_path, True, rank) for rank in range(2)]
    assert [[len(labels) for _, labels in loaders.train] for loaders in dropped] == [[4], [4]]


def sampler_loaders(samples: int, world_size: int) -> Loaders:
    sampler = ShardedSampler(samples, world_size, 0)
    return Loaders(train=[], val=[], train_sampler=sampler, train_size=samples, val_size=0)


def test_the_start_up_line_says_what_becomes_of_the_last_batch():
    cfg = load_config(None, ["data.synthetic=true", "train.batch_size=32", "train.drop_last=false"])
    # 1,437 digits on 2 ranks: 719 each (one padded), 22 batches of 32 and one of 15 per rank.
    assert last_batch_note(cfg, sampler_loaders(1437, 2), 2) == \
        " (the last one 15/rank x 2 ranks: train.drop_last=false, 1 sample(s) seen twice to even out the ranks)"
    assert last_batch_note(cfg, sampler_loaders(1438, 2), 2).endswith("train.drop_last=false)")
    assert last_batch_note(cfg, sampler_loaders(1408, 2), 2) == ""  # 704 = 22 x 32: nothing left over
    cfg.train.drop_last = True
    assert last_batch_note(cfg, sampler_loaders(1437, 2), 2) == \
        " (30 samples of the last partial batch left out: train.drop_last=true)"


def test_a_partial_batch_among_accumulated_passes_is_refused_in_one_line():
    """The preset that keeps main.py's last partial batch refuses accumulation in one line that names
    the key to add; with it added, the config loads."""
    for config, overrides in ((None, ["train.drop_last=false"]), ("pytorch_examples", [])):
        with pytest.raises(ConfigError) as error:
            load_config(config, overrides + ["train.backward_passes_per_step=2"])
        assert str(error.value) == (
            "train.backward_passes_per_step=2 also needs train.drop_last=true, and it is false here (as the "
            "pytorch_examples preset sets it, to train on main.py's last partial batch): a partial batch among "
            "accumulated passes would weigh its samples more than the others'; add train.drop_last=true, or keep "
            "train.backward_passes_per_step=1")
    cfg = load_config("pytorch_examples", ["train.backward_passes_per_step=2", "train.drop_last=true"])
    assert (cfg.train.backward_passes_per_step, cfg.train.drop_last) == (2, True)
