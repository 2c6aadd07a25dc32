"""The loaders data/ builds have the capabilities the training loop reads (train/capabilities.py):
a member renamed on one side only would turn a capability off without an error."""

from __future__ import annotations

from types import SimpleNamespace

from torch.utils.data import DataLoader

from hvdtrain.data.image.folder import CountingLoader
from hvdtrain.data.shards.taking import ShardLoader
from hvdtrain.train import capabilities as can
from hvdtrain.train import engine
from hvdtrain.train.bad_data import fails_on_bad_file
from hvdtrain.train.elastic import Elastic
from hvdtrain.train.trainer import Static

BAD_FILES = (can.CountsBadFiles, can.TalliesBadFiles, can.PopsBadFiles, can.SummarizesBadFiles, can.FailsOnBadFile)


def test_a_counting_loader_counts_bad_files_and_takes_no_batches_itself():
    loader = CountingLoader(DataLoader([1, 2]), fail=False)
    assert all(isinstance(loader, capability) for capability in BAD_FILES)
    assert not isinstance(loader, can.CountsTakenBatches)
    assert engine.counts_bad_files(loader) and not engine.counts_taken_batches(loader)
    assert not fails_on_bad_file(loader) and fails_on_bad_file(CountingLoader(DataLoader([1]), fail=True))


def test_a_shard_loader_also_counts_the_batches_taken():
    loader = ShardLoader(DataLoader([1, 2]), SimpleNamespace(notes=[], rank=0, batches_taken=0), fail=False)
    assert all(isinstance(loader, capability) for capability in (*BAD_FILES, can.CountsTakenBatches))
    assert engine.counts_taken_batches(loader)


def test_a_plain_loader_has_none_of_them():
    loader = DataLoader([1, 2])
    assert not any(isinstance(loader, capability) for capability in (*BAD_FILES, can.CountsTakenBatches))
    assert not engine.counts_bad_files(loader) and not fails_on_bad_file(loader)


def test_a_static_run_carries_the_epochs_sums_and_an_elastic_one_commits_them():
    assert hasattr(Static, "sums_so_far") and not hasattr(Elastic, "sums_so_far")
    assert isinstance(Static.__new__(Static), can.CarriesEpochSums)
    assert not isinstance(Elastic.__new__(Elastic), can.CarriesEpochSums)
