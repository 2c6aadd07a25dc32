"""The run's state, in one object with one protocol.

``RunState`` holds everything a run must carry to continue exactly where it was: the model, the
optimizer, the GradScaler, the position (epoch, global step, step and samples in the epoch), the
best validation metric so far, each rank's own random generators and buffers, and any component a
feature registers (EMA weights, a streaming loader's position, ...). Three paths use it, and only
through ``state_dict()`` / ``load_state_dict()`` and ``rank_state()`` / ``load_rank_state()``:

* a checkpoint is ``state_dict()`` plus every rank's ``rank_state()`` (run.checkpoint_payload);
* resume loads a checkpoint into rank 0 and ``dist.broadcast_state`` sends it to every rank;
* an elastic commit keeps a copy of ``state_dict()`` in memory, a rollback loads it back, and a
  reset broadcasts it from rank 0 (elastic.ElasticState).

Adding a piece of state is one call, ``state.register(name, component)``, where ``component`` has
``state_dict()`` and ``load_state_dict()``; the three paths then carry it.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import numpy as np
import torch

from ..model.build import unwrap_state_dict

POSITION_KEYS = ("epoch", "step", "step_in_epoch", "samples_in_epoch")


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class Position:
    """Where the run is. ``samples_in_epoch`` counts the samples all ranks consumed together in the
    epoch: with another number of ranks (a resume, an elastic reset) it, not the step, says where
    the epoch continues."""

    epoch: int = 0             # the epoch in progress
    step: int = 0              # optimizer steps taken in the whole run
    step_in_epoch: int = 0     # optimizer steps completed in that epoch
    samples_in_epoch: int = 0  # samples consumed in that epoch, all ranks together

    def start_epoch(self, epoch: int) -> None:
        self.epoch, self.step_in_epoch, self.samples_in_epoch = epoch, 0, 0


class _Model:
    """The model as a component: saved without wrapper prefixes, on the CPU."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return unwrap_state_dict(self.model)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state)


class RunState:
    """The whole state of a run (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scaler: torch.amp.GradScaler | None = None):
        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler
        self.position = Position()
        self.best_metric: float | None = None  # the best validation value of the task's best_metric
        self.extra: dict[str, Stateful] = {}

    def register(self, name: str, component: Stateful) -> None:
        """Carry ``component`` in checkpoints, resume broadcasts and elastic commits from now on."""
        if name in self.components() or name in POSITION_KEYS or name == "best_metric":
            raise ValueError(f"state component '{name}' already exists")
        self.extra[name] = component

    def components(self) -> dict[str, Stateful]:
        found: dict[str, Stateful] = {"model": _Model(self.model), "optimizer": self.optimizer}
        if self.scaler is not None:
            found["scaler"] = self.scaler
        found.update(self.extra)
        return found

    def state_dict(self, exclude: tuple[str, ...] = ()) -> dict[str, Any]:
        """Every component's state, the position and the best metric (the same on every rank)."""
        state: dict[str, Any] = {name: component.state_dict() for name, component in self.components().items()
                                 if name not in exclude}
        state.update(asdict(self.position), best_metric=self.best_metric)
        return state

    def load_state_dict(self, state: dict[str, Any], exclude: tuple[str, ...] = ()) -> None:
        """The inverse of ``state_dict``; a component the dict lacks (or has empty) keeps its state."""
        for name, component in self.components().items():
            if name not in exclude and state.get(name):
                component.load_state_dict(state[name])
        for key in POSITION_KEYS:
            setattr(self.position, key, int(state.get(key, 0)))
        self.best_metric = state.get("best_metric")

    def rank_state(self) -> dict[str, Any]:
        """What differs between ranks: the random generators, and mid-epoch the floating buffers
        (without SyncBN each rank's BatchNorm statistics are its own until the epoch end averages
        them). A checkpoint keeps every rank's, so a resumed run continues each rank's exactly."""
        buffers = None
        if self.position.step_in_epoch:
            buffers = {name: b.detach().cpu().clone() for name, b in self.model.named_buffers()
                       if b.is_floating_point()}
        return {"rng": rng_state(), "buffers": buffers}

    def load_rank_state(self, ranks: list[dict[str, Any]], rank: int, world_size: int, fallback_seed: int) -> bool:
        """This rank's own saved state when ``ranks`` (one entry per rank that wrote it) comes from
        ``world_size`` ranks (returns True); with another number of ranks, the average of the saved
        buffers and fresh generators seeded by ``fallback_seed`` (returns False)."""
        same_world = len(ranks) == world_size
        saved = [entry["buffers"] for entry in ranks if entry.get("buffers")]
        if saved:
            named = dict(self.model.named_buffers())
            with torch.no_grad():
                for name in saved[0]:
                    value = saved[rank][name] if same_world else torch.stack([b[name] for b in saved]).mean(0)
                    named[name].copy_(value)
        if same_world and ranks[rank].get("rng"):
            set_rng_state(ranks[rank]["rng"])
            return True
        torch.manual_seed(fallback_seed)
        return False


def rng_state() -> dict[str, Any]:
    """This process's random generators as plain values (loadable with ``weights_only=True``)."""
    kind, keys, position, has_gauss, gauss = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "position": int(position),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy = state["numpy"]
    np.random.set_state((numpy["kind"], numpy["keys"].numpy().astype(np.uint32), numpy["position"],
                         numpy["has_gauss"], numpy["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
