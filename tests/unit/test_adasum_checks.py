"""``dist.op=adasum``'s checks before anything trains: where Horovod 0.28 has Adasum (the MPI
controller; a power-of-2 number of ranks, of hosts with NCCL on GPU), what cannot go with it
(clipping, fp16 AMP's GradScaler), and the batch its learning rate is scaled for (one rank's, as
Horovod's example does). The two-rank runs are tests/parallel/test_adasum.py's."""

from __future__ import annotations

import pytest

from hvdtrain.config import ConfigError
from hvdtrain.job_config import load_config
from hvdtrain.train.builders import lr_batch
from hvdtrain.train.preflight import adasum_problem

BUILT = {"mpi": True, "gloo": True, "nccl": False, "cuda": False}


def test_adasum_runs_on_the_mpi_controller_over_a_power_of_2_ranks():
    assert adasum_problem("mpi", BUILT, 1, 1, gpu=False) is None
    assert adasum_problem("mpi", BUILT, 4, 2, gpu=False) is None
    gloo = adasum_problem("gloo", BUILT, 2, 1, gpu=False)
    assert gloo == ("dist.op=adasum needs Horovod's MPI controller (Horovod's Adasum runs on MPI alone), and this "
                    "job runs on gloo: launch with horovodrun --mpi (hvdtrain launch --mpi) or mpirun, or set "
                    "dist.op=average")
    no_mpi = adasum_problem("gloo", {**BUILT, "mpi": False}, 2, 1, gpu=False)
    assert no_mpi.startswith("dist.op=adasum needs Horovod built with MPI") and "\n" not in no_mpi
    assert adasum_problem("mpi", BUILT, 3, 1, gpu=False) == (
        "dist.op=adasum needs a power-of-2 number of ranks (Horovod's Adasum), and this job has 3: run on 2 or 4, "
        "or set dist.op=average")
    nccl = {**BUILT, "nccl": True}
    assert adasum_problem("mpi", nccl, 6, 2, gpu=True) is None  # hosts count with NCCL: 2 of 3 ranks each
    assert "power-of-2 number of hosts (Horovod's Adasum with NCCL), and this job has 3" in \
        adasum_problem("mpi", nccl, 6, 3, gpu=True)


def test_the_rate_under_adasum_is_one_ranks_not_scaled_by_the_ranks():
    assert lr_batch("average", 1024, 4, 4, gpu_adasum=False) == 1024
    assert lr_batch("adasum", 1024, 4, 4, gpu_adasum=False) == 256    # 128 images x 2 passes on each of 4 ranks
    assert lr_batch("adasum", 1024, 8, 4, gpu_adasum=True) == 512     # a host's: NCCL within it (x its 4 ranks)
    cfg = load_config("debug", ["dist.op=adasum"])
    assert cfg.optim.base_lr * lr_batch("adasum", 16, 2, 2, False) / 256 == pytest.approx(0.0125)


@pytest.mark.parametrize("override, named", [
    ("optim.clip_grad_norm=1", "optim.clip_grad_norm=1"),
    ("amp.enabled=true", "amp.dtype=float16 (its GradScaler)"),
])
def test_what_needs_the_gradients_before_the_step_is_refused_under_adasum(override, named):
    load_config("debug", [override])
    with pytest.raises(ConfigError) as caught:
        load_config("debug", ["dist.op=adasum", override])
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"dist.op=adasum and {named} exclude each other"), message
    assert load_config("debug", ["dist.op=adasum", "amp.enabled=true", "amp.dtype=bfloat16"]).dist.op == "adasum"


def test_gradient_predivide_factor_is_positive_not_with_adasum_and_sends_per_tensor():
    import torch

    from hvdtrain.train.builders import bucket_mb_for

    cfg = load_config("debug", ["dist.gradient_predivide_factor=2"])
    assert bucket_mb_for(cfg, torch.device("cpu")) == 0  # Horovod's groups would leave the factor out
    assert bucket_mb_for(load_config("debug"), torch.device("cpu")) == 25
    for overrides in (["dist.gradient_predivide_factor=0"], ["dist.op=adasum", "dist.gradient_predivide_factor=2"]):
        with pytest.raises(ConfigError, match=r"^config key 'dist.gradient_predivide_factor' must be positive, and 1 "
                                              r"with dist.op=adasum"):
            load_config("debug", overrides)
