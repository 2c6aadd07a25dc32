"""A worker that joins an elastic job must reach ``ElasticState.sync`` without a collective: its
running peers are waiting there, and any other collective hangs the job (the newcomer in a
broadcast, the others in sync's allgather). Setup and the elastic start (resume included) run here
in-process, with every Horovod collective made to fail."""

from __future__ import annotations

import pytest

from hvdtrain.comm import dist, horovod_engine
from hvdtrain.job_config import load_config

COLLECTIVES = ("allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
               "grouped_allreduce_", "allgather", "allgather_object", "broadcast", "broadcast_",
               "broadcast_async_", "broadcast_object", "broadcast_parameters", "broadcast_optimizer_state",
               "alltoall", "barrier", "join")


def elastic_config(data, run_dir):
    return load_config("debug", [f"data.dir={data}", f"output.dir={run_dir}", "train.epochs=2",
                                 "train.steps_per_epoch=2", "elastic.enabled=true", "elastic.sample_log=true",
                                 "runtime.stats_interval=0"])


def newcomer_start(cfg):
    """What a joining worker runs before ``Elastic.run`` (trainer.Trainer.fit)."""
    from hvdtrain.train.elastic import Elastic
    from hvdtrain.train.outputs import finish
    from hvdtrain.train.run import setup

    membership = Elastic()
    membership.check(cfg)
    run = setup(cfg)
    try:
        membership.start(run)
    finally:
        finish(run, membership.outputs if hasattr(membership, "outputs") else [])
    return run


@pytest.mark.parametrize("with_checkpoint", [False, True], ids=["new-run", "resumed-run"])
def test_a_joining_worker_calls_no_collective_before_the_state_sync(tiny_data, tmp_path, monkeypatch,
                                                                    with_checkpoint):
    run_dir = tmp_path / "run"
    # A test before this one may have started Horovod with hvdtrain's CPU defaults in the environment,
    # one of which elastic runs refuse (comm/horovod_env.py); this process's Horovod is not restarted.
    monkeypatch.delenv("HOROVOD_CYCLE_TIME", raising=False)
    if with_checkpoint:  # a first worker trained an epoch and checkpointed (collectives allowed here)
        from hvdtrain.train.trainer import Trainer

        cfg = elastic_config(tiny_data, run_dir)
        cfg.train.epochs = 1
        Trainer(cfg).fit()
        assert (run_dir / "checkpoints" / "last.pt").exists() or any(run_dir.rglob("*.pt"))
    dist.init(gpu=False, elastic=True)
    called: list[str] = []

    def banned(name):
        def call(*args, **kwargs):
            called.append(name)
            raise AssertionError(f"hvd.{name} called by a joining elastic worker before the state sync")
        return call

    for name in COLLECTIVES:
        if hasattr(horovod_engine.hvd, name):
            monkeypatch.setattr(horovod_engine.hvd, name, banned(name))
    run = newcomer_start(elastic_config(tiny_data, run_dir))
    assert called == []
    assert run.start_epoch == (1 if with_checkpoint else 0)
