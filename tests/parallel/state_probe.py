"""A new piece of run state goes through checkpoint, broadcast and elastic sync with no other change.

Usage (2 ranks under a launcher): state_probe.py OUT_DIR. Registers a component that no hvdtrain
module knows about, then drives the three paths the run state takes; writes OUT_DIR/rank<r>.json
with what each rank saw at each stage.
"""

import json
import sys
from pathlib import Path

import torch

from hvdtrain.checkpoint import io as checkpoint
from hvdtrain.comm import dist
from hvdtrain.train.elastic import ElasticState
from hvdtrain.train.state import RunState


class Counter:
    """A stand-in for a future feature's state (an EMA, a stream position): a tensor and a number."""

    def __init__(self) -> None:
        self.total = torch.zeros(3)
        self.seen = 0

    def state_dict(self) -> dict:
        return {"total": self.total.clone(), "seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.total, self.seen = state["total"].clone(), int(state["seen"])

    def snapshot(self) -> list:
        return [self.total.tolist(), self.seen]


def build() -> tuple[RunState, Counter]:
    torch.manual_seed(100 + dist.rank())  # every rank starts different
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    optimizer = dist.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                           model.named_parameters(), compression="none",
                                           backward_passes_per_step=1, op="average")
    state = RunState(model, optimizer)
    counter = Counter()
    state.register("counter", counter)
    return state, counter


def step(state: RunState) -> None:
    state.model(torch.randn(8, 4)).square().mean().backward()
    state.optimizer.step()
    state.optimizer.zero_grad()


def main() -> None:
    out = Path(sys.argv[1])
    dist.init(gpu=False)
    rank = dist.rank()
    state, counter = build()
    seen: dict = {}

    # Broadcast: rank 0's value reaches every rank.
    counter.total += rank + 1
    counter.seen = 10 * (rank + 1)
    state.position.step = 7 if rank == 0 else 0
    dist.broadcast_state(state)
    seen["broadcast"] = counter.snapshot() + [state.position.step]
    seen["model_after_broadcast"] = state.model[0].weight.sum().item()

    # Checkpoint: rank 0 writes state_dict(); a fresh state loads it back.
    step(state)
    counter.total += 1
    counter.seen += 1
    path = out / "state.pt"
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        checkpoint.atomic_save({**state.state_dict(), "config": {}}, path)
    dist.barrier()
    fresh, fresh_counter = build()
    fresh.load_state_dict(checkpoint.load(path))
    seen["checkpoint"] = fresh_counter.snapshot() + [fresh.position.step]
    seen["checkpoint_momentum_equal"] = all(
        torch.equal(a["momentum_buffer"], b["momentum_buffer"])
        for a, b in zip(state.optimizer.state_dict()["state"].values(),
                        fresh.optimizer.state_dict()["state"].values()))

    # Elastic: commit, change, roll back; then sync from rank 0 after the ranks diverged.
    elastic = ElasticState(state, sum_width=2)
    elastic.commit()
    committed = counter.snapshot()
    counter.total += 5
    counter.seen += 5
    step(state)
    elastic.restore()
    seen["restored"] = counter.snapshot()
    seen["restored_equals_committed"] = counter.snapshot() == committed
    # The ranks diverge, and rank 1 has trained further (as when rank 0 is a worker that has just
    # joined): the sync takes rank 1's state.
    counter.seen += 100 * rank
    seen["bias_before_sync"] = state.model[0].bias.sum().item()
    if rank == 1:
        with torch.no_grad():  # (a real step would allreduce, with rank 0 not taking part)
            state.model[0].bias += 1
        state.position.step += 1
    elastic.sync()
    seen["synced"] = counter.snapshot() + [state.position.step]
    seen["model_after_sync"] = [p.sum().item() for p in state.model.parameters()]
    seen["bias_moved"] = state.model[0].bias.sum().item() - seen.pop("bias_before_sync")
    (out / f"rank{rank}.json").write_text(json.dumps(seen))


# tests/shared_ranks: this script may run on the shared ranks
if __name__ == "__main__":
    main()
