import torch

from hvdtrain.config import Config
from hvdtrain.observe.metrics import MetricSums
from hvdtrain.tasks.image_classification import ImageClassification, hit_counts, summarize


def test_hit_counts_top1_top5():
    logits = torch.tensor([[9.0, 1, 2, 3, 4, 5, 6],    # target 0: top-1 hit
                           [1.0, 9, 2, 3, 4, 5, 6],    # target 6: second best, top-5 hit
                           [9.0, 8, 7, 6, 5, 1, 0]])   # target 6: worst, miss
    top1, top5 = hit_counts(logits, torch.tensor([0, 6, 6]))
    assert (int(top1), int(top5)) == (1, 2)


def test_topk_capped_by_number_of_classes():
    top1, top5 = hit_counts(torch.tensor([[0.1, 0.9], [0.8, 0.2]]), torch.tensor([0, 0]))
    assert (int(top1), int(top5)) == (1, 2)


def test_reduction_uses_sums_not_means_of_means():
    # Rank 0: 3 images with mean loss 1.0, all top-1 hits; rank 1: 1 image with loss 5.0, a miss.
    task = ImageClassification(Config())
    width = len(task.sum_fields)
    rank0, rank1 = MetricSums(width), MetricSums(width)
    rank0.add(task.metric_sums(torch.tensor(1.0), torch.eye(3) * 5, torch.tensor([0, 1, 2])))
    rank1.add(task.metric_sums(torch.tensor(5.0), torch.tensor([[5.0, 0, 0]]), torch.tensor([1])))
    result = task.summarize(rank0.values + rank1.values)
    assert result["loss"] == 2.0              # (3 * 1 + 1 * 5) / 4, not (1 + 5) / 2
    assert result["top1"] == 75.0 and result["top5"] == 100.0
    assert result["samples"] == 4
    # reduced() hands the local sums to the collective and returns what comes back.
    assert task.summarize(rank0.reduced(lambda t: t + rank1.values)) == result


def test_empty_shard_contributes_zeros():
    sums = MetricSums(4)
    assert sums.reduced(lambda t: t).tolist() == [0.0] * 4
    assert summarize(sums.local())["samples"] == 0
