"""The checks a rank would make of the model and the task, made before any rank starts.

A config can be valid key by key and still be refused by the ranks once they have built the model:
a weight-decay exemption or a freeze pattern that names no parameter, a classifier head that is not
there, a metric the task does not declare for best.pt or train.target. On the ranks that is tens of
seconds in (the launcher, Horovod, the file index, the loaders), with the launcher's output around
it. Here it is the same one line, before the launch: the model is built on the meta device (its
parameter names and shapes, no memory, no initialization cost) and the same functions the ranks
call refuse what they would refuse.

Called by ``--print-config``, by each rank's ``train`` command before it imports Horovod, by
``hvdtrain launch`` and ``hvdtrain ray`` on the command they start (``check_train_args``), and by
``fit``/``fit_model`` before Horovod starts. Only the built-in image task is built here: the
recommender's model depends on its data, and a task of one's own may build anything.
"""

from __future__ import annotations

import os
from typing import Mapping

from ..config import Config, ConfigError


def check_before_launch(cfg: Config) -> None:
    """Raise the ConfigError a rank would raise at start-up on this config's model and task settings."""
    if cfg.task != "image_classification":
        return
    import torch

    from ..model.build import build_model
    from ..model.finetune import apply_freeze
    from ..optim.build import optimizer_groups
    from ..tasks import metric_direction
    from ..tasks.image_classification import ImageClassification

    task = ImageClassification(cfg)
    metric_direction(task, cfg.checkpoint.best_metric or task.best_metric, "checkpoint.best_metric")
    if cfg.train.target_metric:
        metric_direction(task, cfg.train.target_metric, "train.target_metric")
    try:
        with torch.device("meta"):
            model = build_model(cfg.model, cfg.model.num_classes or 1000)
    except ConfigError:
        raise
    except Exception:  # noqa: BLE001 -- a model that cannot be built on the meta device: the ranks check it
        return
    apply_freeze(model, cfg.model.freeze, cfg.model.arch)
    optimizer_groups(model, cfg.optim)


def check_train_args(train_args: list[str], prog: str, own_tasks: bool = True) -> Config | None:
    """A train command's arguments (``--config FILE``, ``key=value``...) as its ranks will read them,
    checked here: the config, the data choice and ``check_before_launch``. ``own_tasks=False``: a
    config whose task is not a shipped one is left to the ranks (its module may be importable only
    where they run: another PYTHONPATH, files on the compute nodes). Returns the config checked
    (None: left to the ranks)."""
    from ..arguments import require_data_choice, train_parser
    from ..job_config import load_config
    from ..tasks.registry import TASKS

    args = train_parser(prog).parse_args(train_args)
    if not own_tasks and load_config(args.config, args.overrides, check=False).task not in TASKS:
        return None
    cfg = load_config(args.config, args.overrides)
    require_data_choice(args.config, cfg)
    check_before_launch(cfg)
    return cfg


# Interpreter options without a value that may come before ``-m hvdtrain`` (-P: the working folder
# is not put on sys.path; -u: unbuffered; -B, -E, -s, -I, -O).
PYTHON_FLAGS = ("-P", "-u", "-B", "-E", "-s", "-I", "-O", "-OO")


def hvdtrain_train_args(command: list[str]) -> list[str] | None:
    """The train arguments of a command that starts hvdtrain's train command (``python -m hvdtrain
    [train] ARGS``, ``hvdtrain [train] ARGS``), or None for any other program or hvdtrain command."""
    if not command:
        return None
    name = os.path.basename(command[0])
    options = 1
    while options < len(command) and command[options] in PYTHON_FLAGS:  # python -P -u -m hvdtrain
        options += 1
    if name.startswith("python") and command[options:options + 2] == ["-m", "hvdtrain"]:
        rest = command[options + 2:]
    elif name == "hvdtrain":  # the console script
        rest = command[1:]
    else:
        return None
    from ..arguments import HELP_WORDS, SUMMARIES, looks_like_command

    if rest and rest[0] == "train":
        return rest[1:]
    if rest and (rest[0] in SUMMARIES or rest[0] in HELP_WORDS or looks_like_command(rest[0])):
        return None
    return rest


def adasum_problem(controller: str, built: Mapping[str, bool], size: int, hosts: int, gpu: bool) -> str | None:
    """Why Horovod 0.28 cannot run ``dist.op=adasum`` in this job, or None: its Adasum runs on the
    MPI controller alone (operations.cc builds no Adasum for Gloo), over a power-of-2 number of
    ranks on CPU, of hosts with NCCL on GPU (torch/mpi_ops.py)."""
    fix = "or set dist.op=average"
    if not built.get("mpi"):
        return ("dist.op=adasum needs Horovod built with MPI (Horovod's Adasum runs on MPI alone), and this one "
                f"has no MPI: install Open MPI and rebuild Horovod (make setup), {fix}")
    if controller != "mpi":
        return (f"dist.op=adasum needs Horovod's MPI controller (Horovod's Adasum runs on MPI alone), and this job "
                f"runs on {controller}: launch with horovodrun --mpi (hvdtrain launch --mpi) or mpirun, {fix}")
    nccl = gpu and built.get("nccl", False)
    count, what = (hosts, "hosts") if nccl else (size, "ranks")
    if count & (count - 1):
        return (f"dist.op=adasum needs a power-of-2 number of {what} (Horovod's Adasum{' with NCCL' if nccl else ''}), "
                f"and this job has {count}: run on {1 << (count.bit_length() - 1)} or {1 << count.bit_length()}, {fix}")
    return None

