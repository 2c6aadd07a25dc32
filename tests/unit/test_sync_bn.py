"""SyncBatchNorm's arithmetic, checked in one process by simulating the ranks' collectives."""

import pytest
import torch

from hvdtrain.model import sync_bn


@pytest.fixture
def float64():
    """In float64 (SyncBN keeps the input's precision above float32), so that the tolerances sit
    far above rounding on any processor and thread count."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def test_two_shards_match_batchnorm_over_the_whole_batch(monkeypatch, float64):
    torch.manual_seed(0)
    x = torch.randn(8, 3, 5, 5) * 3 + 1
    weight = torch.randn(3)
    bias = torch.randn(3)
    upstream = torch.randn(8, 3, 5, 5)

    reference = torch.nn.BatchNorm2d(3)
    with torch.no_grad():
        reference.weight.copy_(weight)
        reference.bias.copy_(bias)
    xr = x.clone().requires_grad_()
    expected = reference(xr)
    (expected * upstream).sum().backward()

    # Simulate 2 ranks, each holding half of the batch: the collectives return what the two
    # ranks together would produce. Rank 0 runs forward first, then rank 1, then both backward.
    shards = [x[:4].clone().requires_grad_(), x[4:].clone().requires_grad_()]
    stats, grads = [], []

    def fake_allgather(tensor, name=None):
        stats.append(tensor)
        if len(stats) == 1:  # rank 0's forward: compute both ranks' statistics up front
            other = shards[1].detach()
            var, mean = torch.var_mean(other, dim=[0, 2, 3], correction=0)
            return torch.cat([tensor, torch.cat([torch.tensor([float(other.numel() // 3)]), mean, var])[None]])
        return torch.cat([stats[0], tensor])

    def fake_allreduce(tensor, name=None):
        grads.append(tensor)
        return pending_total

    monkeypatch.setattr(sync_bn.dist, "size", lambda: 2)
    monkeypatch.setattr(sync_bn.dist, "allgather", fake_allgather)
    monkeypatch.setattr(sync_bn.dist, "allreduce_sum", fake_allreduce)

    layers = [sync_bn.SyncBatchNorm(3), sync_bn.SyncBatchNorm(3)]
    outputs = []
    for layer, shard in zip(layers, shards):
        with torch.no_grad():
            layer.weight.copy_(weight)
            layer.bias.copy_(bias)
        outputs.append(layer(shard))
    assert outputs[0].dtype == torch.float64
    torch.testing.assert_close(torch.cat(outputs), expected.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(layers[0].running_var, reference.running_var, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(layers[1].running_mean, reference.running_mean, rtol=1e-10, atol=1e-12)

    # Backward: the allreduced sums are the sums over both shards.
    total_dy = upstream.sum([0, 2, 3])
    x_hat = (x - x.mean([0, 2, 3], keepdim=True)) / torch.sqrt(x.var([0, 2, 3], unbiased=False, keepdim=True) + 1e-5)
    pending_total = torch.cat([total_dy, (upstream * x_hat).sum([0, 2, 3])])
    for output, up in zip(outputs, (upstream[:4], upstream[4:])):
        (output * up).sum().backward()
    torch.testing.assert_close(torch.cat([s.grad for s in shards]), xr.grad, rtol=1e-9, atol=1e-11)
    # Parameter gradients stay local; the distributed optimizer sums/averages them like any other.
    torch.testing.assert_close(layers[0].weight.grad + layers[1].weight.grad, reference.weight.grad,
                               rtol=1e-9, atol=1e-11)
