"""train.drop_last=false on 2 launched ranks: the epoch's last partial batch is trained on, padded as
DistributedSampler pads, and every step is plain SGD on that step's global batch: the parameters of
both ranks equal those of SGD by hand over the same global batches in one process (float64), and the
epoch has one step more than with the default. Validation still counts every sample once."""

from __future__ import annotations

import json
import textwrap

import torch

from tests.helpers import launch

SAMPLES, VAL, PER_RANK_BATCH, RANKS, EPOCHS, LR = 13, 7, 4, 2, 2, 0.05

PROBE = textwrap.dedent(f"""
    import sys
    import torch
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    import hvdtrain

    generator = torch.Generator().manual_seed(5)
    inputs = torch.randn({SAMPLES + VAL}, 3, generator=generator, dtype=torch.float64)
    targets = torch.randn({SAMPLES + VAL}, 2, generator=generator, dtype=torch.float64)
    train_set = TensorDataset(inputs[:{SAMPLES}], targets[:{SAMPLES}])
    val_set = TensorDataset(inputs[{SAMPLES}:], targets[{SAMPLES}:])
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).double()
    optimizer = torch.optim.SGD(model.parameters(), lr={LR})
    result = hvdtrain.fit_model(model, optimizer, train_set, val_set, F.mse_loss, config={{
        "train.epochs": {EPOCHS}, "train.batch_size": {PER_RANK_BATCH}, "train.drop_last": sys.argv[2] == "true",
        "model.dtype": "float64", "output.dir": sys.argv[1], "runtime.threads": 1}})
    torch.save({{k: v.clone() for k, v in result.model.state_dict().items()}},
               f"{{sys.argv[1]}}/rank{{result.rank}}.pt")
""")


def by_hand() -> dict[str, torch.Tensor]:
    """SGD in one process over the global batches 2 ranks train on with train.drop_last=false: the
    epoch's order (torch.randperm from seed + epoch), padded by wrapping around to a multiple of the
    ranks, rank r taking positions r, r + 2, ...; a step's global batch is both ranks' batches."""
    from hvdtrain.data.sampler import ShardedSampler

    generator = torch.Generator().manual_seed(5)
    inputs = torch.randn(SAMPLES + VAL, 3, generator=generator, dtype=torch.float64)
    targets = torch.randn(SAMPLES + VAL, 2, generator=generator, dtype=torch.float64)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for epoch in range(EPOCHS):
        shares = []
        for rank in range(RANKS):
            sampler = ShardedSampler(SAMPLES, RANKS, rank, seed=0)
            sampler.set_epoch(epoch)
            shares.append(sampler.indices())
        assert len({len(share) for share in shares}) == 1  # padded: every rank has as many
        for first in range(0, len(shares[0]), PER_RANK_BATCH):
            # Horovod averages the ranks' mean losses' gradients; with equal batches, the global mean.
            losses = [torch.nn.functional.mse_loss(model(inputs[share[first:first + PER_RANK_BATCH]]),
                                                   targets[share[first:first + PER_RANK_BATCH]])
                      for share in shares]
            optimizer.zero_grad()
            (sum(losses) / RANKS).backward()
            optimizer.step()
    return model.state_dict()


def records(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_two_ranks_train_the_last_partial_batch_as_sgd_on_the_global_batch(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    kept, dropped = tmp_path / "kept", tmp_path / "dropped"
    result = launch("horovodrun-gloo", RANKS, [str(probe), str(kept), "false"], tmp_path)
    assert "the last one 3/rank x 2 ranks: train.drop_last=false, 1 sample(s) seen twice" in result.stdout
    expected = by_hand()
    for rank in range(RANKS):
        state = torch.load(kept / f"rank{rank}.pt")
        for name, value in expected.items():
            torch.testing.assert_close(state[name], value, rtol=1e-12, atol=1e-14)
    train = [r for r in records(kept) if r["split"] == "train"]
    val = [r for r in records(kept) if r["split"] == "val"]
    # 13 samples, 2 ranks x 4: 7 per rank (one padded), batches 4 + 3: 2 steps an epoch, 14 samples.
    assert [r["step"] for r in train] == [2, 4] and all(r["samples"] == 14 for r in train)
    assert all(r["samples"] == VAL for r in val)
    launch("horovodrun-gloo", RANKS, [str(probe), str(dropped), "true"], tmp_path)
    train = [r for r in records(dropped) if r["split"] == "train"]
    assert [r["step"] for r in train] == [1, 2] and all(r["samples"] == 8 for r in train)
