"""What ``--print-config`` shows: the config as given, and what is in effect at a number of ranks.

Two keys yield to others: ``train.batch_size`` to ``train.global_batch_size`` (the batch per rank
then follows from the number of ranks), ``optim.base_lr`` to ``optim.lr`` or ``optim.lr_per_rank``.
The printed YAML keeps the keys as given, so that it can be saved and run at any number of ranks;
a comment on each key that yields says what is in effect instead and where it comes from, and the
lines after the config give the batch per rank, the global batch and the learning rate at the
number of ranks of the launch (or, not launched, the number assumed, said as such).

Light on purpose: no data, no loaders, no Horovod; the rate comes from the one ``LRSchedule`` the
ranks build.
"""

from __future__ import annotations

import os

from ..comm import launcher_env as launcher
from ..config import Config, ConfigError, TrainConfig, dump_yaml


def per_rank_batch(train: TrainConfig, world_size: int) -> int:
    """The batch of one rank per backward pass at ``world_size`` ranks: ``train.global_batch_size``
    divided by the ranks and passes where it is set, else ``train.batch_size``. A global batch the
    ranks and passes do not divide, or an explicit ``train.batch_size`` that disagrees, stops with one
    line. (An explicit batch size equal to the default cannot be told from the default, and yields to
    the global one.)"""
    wanted, passes = train.global_batch_size, train.backward_passes_per_step
    if not wanted:
        return train.batch_size
    shares = world_size * passes
    if wanted % shares:
        lower, upper = wanted // shares * shares, (wanted // shares + 1) * shares
        raise ConfigError(f"train.global_batch_size={wanted} does not divide into {world_size} ranks x {passes} "
                          f"passes: use a multiple of {shares} (e.g. {lower or upper} or {upper}), or another "
                          f"number of ranks")
    per_rank = wanted // shares
    if train.batch_size not in (TrainConfig.batch_size, per_rank):
        raise ConfigError(f"train.batch_size={train.batch_size} and train.global_batch_size={wanted} disagree at "
                          f"{world_size} ranks x {passes} passes ({per_rank} per rank): set one of the two")
    return per_rank


def launch_variable() -> str:
    """The variable by which a launcher gave this process its number of ranks, or "" (not launched)."""
    return next((name for name in launcher.SIZE_VARIABLES if name in os.environ), "")


def world_for(cfg: Config) -> tuple[int, str]:
    """(ranks, how that number was found): the launch's; not launched, the number at which an
    explicit ``train.batch_size`` and ``train.global_batch_size`` agree, else 1."""
    variable = launch_variable()
    if variable:
        return launcher.size(), f"the launch's: {variable}={os.environ[variable]}"
    train = cfg.train
    shares = train.batch_size * train.backward_passes_per_step
    if train.global_batch_size and train.batch_size != TrainConfig.batch_size and not train.global_batch_size % shares:
        world = train.global_batch_size // shares
        return world, (f"assumed, not launched: the number at which train.batch_size={train.batch_size} and "
                       f"train.global_batch_size={train.global_batch_size} agree")
    return 1, "assumed, not launched: one process; a launch's number of ranks replaces it"


def plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 'es' if word.endswith('s') else 's'}"


def in_effect(cfg: Config, world_size: int) -> tuple[list[tuple[str, str, str]], dict[tuple[str, str], str]]:
    """What is in effect at ``world_size`` ranks: rows (what, value, where it comes from) for the batch
    per rank, the global batch, the peak rate and the warm-up's start; and the comment for each key
    that yields to another, by (section, key)."""
    from ..optim.build import REFERENCE_BATCH, LRSchedule  # imports torch: after the config is read

    train, optim = cfg.train, cfg.optim
    passes = train.backward_passes_per_step
    batch = per_rank_batch(train, world_size)
    ranks, steps = plural(world_size, "rank"), plural(passes, "pass")
    global_batch = batch * world_size * passes
    notes: dict[tuple[str, str], str] = {}
    if train.global_batch_size:
        derived = f"derived from train.global_batch_size {train.global_batch_size} / ({ranks} x {steps})"
        rows = [("batch per rank", f"{batch}", derived),
                ("global batch", f"{global_batch}", "train.global_batch_size")]
        notes["train", "batch_size"] = f"in effect: {batch} per rank at {ranks}, {derived}"
    else:
        rows = [("batch per rank", f"{batch}", "train.batch_size"),
                ("global batch", f"{global_batch}", f"derived: {batch}/rank x {ranks} x {steps}")]
    # Adasum scales the rate for one rank's batch (on CPU; a host's over NCCL: the start-up line says).
    rate_batch = global_batch // world_size if cfg.dist.op == "adasum" else global_batch
    schedule = LRSchedule.from_config(optim, rate_batch, train.epochs, 1, rank_batch=batch, passes=passes)
    peak = f"{schedule.peak_lr:.6g}"
    adasum = f"; Adasum: for {rate_batch} images" if rate_batch != global_batch else ""
    if optim.lr > 0:
        rows.append(("peak learning rate", peak, "optim.lr, as given, not scaled by the global batch"))
        notes["optim", "base_lr"] = "not in effect: optim.lr sets the rate"
    elif optim.lr_per_rank > 0:
        rows.append(("peak learning rate", peak, f"derived from optim.lr_per_rank {optim.lr_per_rank:g} for one "
                                                 f"rank's {batch} images x {rate_batch} / {batch}{adasum}"))
        notes["optim", "base_lr"] = f"not in effect: optim.lr_per_rank sets the rate ({peak} at {ranks})"
    else:
        per = REFERENCE_BATCH
        rows.append(("peak learning rate", peak, f"derived from optim.base_lr {optim.base_lr:g} per {per} images x "
                                                 f"{rate_batch} / {per}{adasum}"))
    if optim.warmup_epochs > 0 and schedule.start_lr != schedule.peak_lr:
        rows.append(("warm-up from", f"{schedule.start_lr:.6g}", f"over {optim.warmup_epochs:g} epochs to {peak}"))
    return rows, notes


def annotated_yaml(cfg: Config, world_size: int | None = None, why: str = "") -> str:
    """``--print-config``'s text: the config as YAML, a comment on each key that yields to another,
    then what is in effect at ``world_size`` ranks (default: world_for)."""
    if world_size is None:
        world_size, why = world_for(cfg)
    rows, notes = in_effect(cfg, world_size)
    lines, section = [], ""
    for line in dump_yaml(cfg).splitlines():
        if line and not line.startswith(" "):
            section = line.split(":", 1)[0]
        elif line.startswith("  ") and not line.startswith("   "):
            note = notes.get((section, line.strip().split(":", 1)[0]))
            line += f"  # {note}" if note else ""
        lines.append(line)
    lines.append(f"# In effect at {plural(world_size, 'rank')} ({why}):")
    lines += [f"#   {what}: {value} ({source})" for what, value, source in rows]
    return "\n".join(lines) + "\n"
