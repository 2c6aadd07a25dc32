"""A run that starts from a checkpoint: ``resume`` (rank 0 loads, after checking it continues this
run; every rank gets its state), the line that says so, and ``evaluate_checkpoint``, which
validates a saved model. train/run.py sets the run up; train/save.py writes the checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..checkpoint import io as checkpoint
from ..checkpoint.identity import differences, listed, model_fit, refusal
from ..comm import dist
from ..comm.dist import log
from ..config import Config, ConfigError
from ..data.files.bad_files import vanished_classes
from ..model.finetune import load_weights
from .engine import evaluate
from .run import Run, release, setup, where


def resume(run: Run, path: Path | None = None, broadcast: bool = True) -> None:
    """The one way a run starts from a checkpoint. Rank 0 loads it (``path``, or what
    ``checkpoint.resume`` finds) after checking that it continues this run (``same_run``; not for an
    explicit ``path``, which evaluation passes) and that the model fits; a fresh run starts from
    ``model.weights`` if set. Then, with ``broadcast``, everything rank 0 has goes to every rank (a
    fresh run too: every rank starts from rank 0's initial state); an elastic run passes
    ``broadcast=False``, since its state synchronization brings every rank up to date.

    Each rank gets back its own random generators and buffers when the number of ranks is
    unchanged. With another number of ranks the position in the epoch is carried over as a count
    of samples, so the global sample order, the epoch and the learning rate continue where they were.
    """
    found, refused = None, None
    if dist.is_primary():
        found = ((path, checkpoint.load(path)) if path is not None
                 else checkpoint.load_for_resume(run.cfg.checkpoint.resume, run.run_dir / "checkpoints", log,
                                                 share=run.cfg.output.share))
        if found is not None:
            foreign = found[1].get("written_by") == checkpoint.HOROVOD_EXAMPLE
            if foreign:  # Horovod's example's: model and optimizer, the epoch from the file's name
                refused = example_problem(run, found) if path is None else None
                found = (Path(f"{found[0]} (Horovod's example's, after {found[1]['epoch']} epochs)"), found[1])
            else:
                refused = same_run(run, found) if path is None else None
            # A class folder gone is said as such, before the classifier's shape it changes (model_fit).
            refused = refused or vanished_classes(found[1].get("task") or {}, run.task.checkpoint_metadata(),
                                                  str(found[0]), f"{run.cfg.data.dir or 'the data'}/train")
            refused = refused or model_fit(found[1].get("model", {}), run.state.model, str(found[0]))
            if refused is None:
                run.state.load_state_dict(adopt_example(run, found[1], path is None) if foreign else found[1])
        elif run.cfg.model.weights:  # a fresh run starts from model.weights; the broadcast below shares them
            log(f"hvdtrain: {load_weights(run.state.model, run.cfg.model)}")
    if not broadcast:
        if refused:
            raise ConfigError(refused)
        if found is not None:
            run.start_epoch = run.state.position.epoch
            log(resumed_line(run, str(found[0])))
        return
    resumed = dist.broadcast_object(
        None if found is None else {"source": str(found[0]), "ranks": found[1].get("ranks", []), "refused": refused,
                                    "train_sums": found[1].get("train_sums")},
        name="hvdtrain.resumed")
    if resumed is not None and resumed["refused"]:
        raise ConfigError(resumed["refused"])  # every rank, before anything is loaded or written
    dist.broadcast_state(run.state)
    if resumed is None:
        return
    position = run.state.position
    position.step_in_epoch = position.samples_in_epoch // run.global_batch
    run.start_epoch = position.epoch
    run.resumed_train_sums = resumed.get("train_sums") if position.step_in_epoch else None
    ranks = resumed["ranks"]
    same_world = run.state.load_rank_state(ranks, dist.rank(), dist.size(),
                                           fallback_seed=run.cfg.seed + 1000003 * dist.rank() + position.step)
    log(resumed_line(run, resumed["source"]))
    if not same_world and ranks and not run.evaluating:  # an evaluation steps nothing: no rate to rescale
        rounded = position.samples_in_epoch - position.step_in_epoch * run.global_batch
        log(f"hvdtrain: the checkpoint was written by {len(ranks)} ranks, this job has {dist.size()}: "
            f"global batch {run.global_batch}, learning rate rescaled"
            + (f"; {rounded} samples of the interrupted step are seen again" if rounded else ""))


def resumed_line(run: Run, source: str) -> str:
    """'resumed from FILE at epoch 4 (global step 88)', or for an evaluation 'evaluating FILE: the
    model after 3 epochs (global step 66)'."""
    position = run.state.position
    if run.evaluating:
        trained = f"{position.epoch} epoch{'s' if position.epoch != 1 else ''}" + \
            (f" and {position.step_in_epoch} step(s)" if position.step_in_epoch else "")
        return f"hvdtrain: evaluating {source}: the model after {trained} (global step {position.step})"
    return f"hvdtrain: resumed from {source} at {where(run)} (global step {position.step})"


def same_run(run: Run, found: tuple[Path, dict[str, Any]]) -> str | None:
    """The checkpoint's config against this run's (checkpoint/identity.py): the line that refuses it, or
    None; what may change, or is forced through, is logged and kept for metrics.jsonl."""
    meaning, allowed = differences(found[1].get("config") or {}, run.cfg)
    forced = run.cfg.checkpoint.resume == "force"
    if meaning and not forced:
        return refusal(str(found[0]), meaning)
    changed = {**meaning, **allowed}
    if changed:
        run.resume_changes = {"forced": sorted(meaning), "changed": {k: list(v) for k, v in changed.items()}}
        log(f"hvdtrain: resuming {found[0]} with changed settings: {listed(changed)}"
            + (" (checkpoint.resume=force; recorded in metrics.jsonl)" if meaning else ""))
    return None


def example_problem(run: Run, found: tuple[Path, dict[str, Any]]) -> str | None:
    """Why Horovod's example's checkpoint cannot continue this run (one line), or None: its optimizer
    state must be an SGD's over this model's parameters in one group (the example's
    ``SGD(model.parameters(), ...)``), with this run's momentum, Nesterov and weight decay."""
    source, saved = found[0], found[1]["optimizer"]
    groups, state = saved.get("param_groups"), saved.get("state")
    if not (isinstance(groups, list) and groups and isinstance(state, dict)
            and all(isinstance(group, dict) and isinstance(group.get("params"), list) for group in groups)):
        return f"checkpoint {source}: its 'optimizer' is not an optimizer's state dict (param_groups and state)"
    count = len(list(run.state.model.parameters()))
    if [index for group in groups for index in group["params"]] != list(range(count)):
        return (f"checkpoint {source}: its optimizer holds {sum(len(g['params']) for g in groups)} parameters in "
                f"{len(groups)} group(s), where the example's holds this model's {count} in one")
    first, optim = groups[0], run.cfg.optim
    theirs = {"optim.name": "sgd" if "dampening" in first else "not SGD", "optim.momentum": first.get("momentum"),
              "optim.nesterov": bool(first.get("nesterov")), "optim.weight_decay": first.get("weight_decay"),
              "optim.no_decay": "none"}
    ours = {"optim.name": optim.name, "optim.momentum": optim.momentum, "optim.nesterov": optim.nesterov,
            "optim.weight_decay": optim.weight_decay, "optim.no_decay": optim.no_decay}
    differ = [f"{key}={theirs[key]} (this run: {ours[key]})" for key in ours if theirs[key] != ours[key]]
    if differ:
        return (f"checkpoint {source} was trained with {', '.join(differ)}: set the example's (--config "
                f"horovod_example has them), or start from its weights alone with model.weights=FILE")
    if run.cfg.ema.decay > 0:
        return f"checkpoint {source} holds no EMA weights to continue: set ema.decay=0"
    return None


def adopt_example(run: Run, payload: dict[str, Any], with_optimizer: bool) -> dict[str, Any]:
    """Horovod's example's payload in this run's layout: the momentum of the example's i-th parameter
    (``model.parameters()`` order) under the index this run's optimizer gives that parameter (its own
    groups: optim.no_decay, heads), this run's hyperparameters kept; the global step from the epochs
    trained and this run's steps per epoch. ``with_optimizer=False`` (an evaluation): the model only."""
    adopted = {**payload, "step": payload["epoch"] * run.steps_per_epoch, "optimizer": {}}
    if with_optimizer:
        saved, optimizer = payload["optimizer"]["state"], run.state.optimizer
        example_index = {id(param): index for index, param in enumerate(run.state.model.parameters())}
        ours = [param for group in optimizer.param_groups for param in group["params"]]
        state = {index: saved[example_index[id(param)]] for index, param in enumerate(ours)
                 if saved.get(example_index[id(param)])}
        adopted["optimizer"] = {"state": state, "param_groups": optimizer.state_dict()["param_groups"]}
    return adopted


def evaluate_checkpoint(cfg: Config, path: Path) -> dict[str, Any]:
    """Validation metrics of a saved model, on however many ranks this job has."""
    run = setup(cfg, writes=False, evaluating=True)
    try:
        resume(run, path)
        model = None
        if cfg.eval.ema:
            if run.ema is None or not run.ema.updates:
                raise ConfigError(f"eval.ema=true: {path} holds no EMA weights (train with ema.decay > 0)")
            model = run.ema.module
        return evaluate(run.state, run.settings, run.loaders.val, dist.allreduce_sum, model=model)
    finally:
        release(run)
