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
            refused = same_run(run, found) if path is None else None
            # A class folder gone is said as such, before the classifier's shape it changes (model_fit).
            refused = refused or vanished_classes(found[1].get("task") or {}, run.task.checkpoint_metadata(),
                                                  str(found[0]), f"{run.cfg.data.dir or 'the data'}/train")
            refused = refused or model_fit(found[1].get("model", {}), run.state.model, str(found[0]))
            if refused is None:
                run.state.load_state_dict(found[1])
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
    if not same_world and not run.evaluating:  # an evaluation steps nothing: no batch or rate to rescale
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
