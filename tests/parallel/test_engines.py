"""The two engines compute the same training: 2 ranks under torchrun with dist.engine=torch end
with identical parameters on both ranks, equal to the same run under horovodrun with the Horovod
engine, and a checkpoint the torch engine wrote mid-run resumes under the Horovod engine to the
uninterrupted result. The run accumulates two backward passes per step, sends float16 gradients
and trains with float16 autocast, a GradScaler and gradient clipping (synchronize, unscale, clip,
step without a second allreduce), so the optimizer protocol, the compression, the accumulation and
the scaler's skipped steps are all compared.

Tolerance: with 2 ranks each averaged element is one addition of the two ranks' values (commutative,
so the same in any ring or order) and a halving (exact), in float16 for both engines; the data,
sampler, seeds and broadcast are the engines' common code. Nothing is expected to differ; the
tolerance (1e-6 absolute, rtol 0) only admits a last-bit difference that a different reduction
order would give with more ranks, and is thousands of times below what one step with unaveraged
(summed) gradients or one skipped step changes (the learning rate is 0.025 x gradients of ~1e-2).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.helpers import PROBE, assert_bitwise_equal, final_states, free_port, launch, read_metrics, tiny

ATOL = 1e-6
COMMON = ["checkpoint.every_steps=1", "checkpoint.keep=10", "output.tensorboard=false",
          "train.steps_per_epoch=2", "train.batch_size=4", "train.backward_passes_per_step=2", "dist.compression=fp16",
          "amp.enabled=true", "amp.dtype=float16", "optim.clip_grad_norm=1.0"]


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a if a[k].is_floating_point())


@pytest.fixture(scope="module")
def torch_run(tiny_data, tmp_path_factory):
    """The torch engine's uninterrupted run under torchrun: (its folder, its ranks' probe files, stdout)."""
    tmp_path = tmp_path_factory.mktemp("torch_engine")
    run_dir = tmp_path / "run"
    result = launch("torchrun", 2, [str(PROBE), str(tmp_path / "probe")]
                    + tiny(tiny_data, run_dir, "dist.engine=torch", *COMMON), tmp_path)
    probes = [torch.load(tmp_path / "probe" / f"rank{r}.pt", weights_only=False) for r in range(2)]
    return run_dir, probes, result.stdout


def test_torch_engine_ranks_end_identical_and_count_every_sample(torch_run):
    run_dir, probes, stdout = torch_run
    assert [(p["rank"], p["size"], p["local_rank"], p["controller"]) for p in probes] == [
        (0, 2, 0, "gloo"), (1, 2, 1, "gloo")]
    assert [p["horovod_modules"] for p in probes] == [[], []]  # the torch engine imports no Horovod
    assert_bitwise_equal(probes[0]["state"], probes[1]["state"])
    assert "2 ranks on 1 host(s) (torch engine, gloo backend)" in stdout, stdout[-2000:]
    assert "compression fp16" in stdout, stdout[-2000:]
    records = read_metrics(run_dir)
    # 2 steps x 2 passes x 4 images x 2 ranks = 32 training images an epoch; 21 validation images once each
    assert [(r["split"], r["epoch"], r["samples"]) for r in records] == [
        ("train", 0, 32), ("val", 0, 21), ("train", 1, 32), ("val", 1, 21)]


def test_torch_engine_equals_the_horovod_engine_and_resumes_under_it(torch_run, tiny_data, tmp_path):
    torch_dir, probes, _ = torch_run
    torch_states = [p["state"] for p in probes]
    launch("horovodrun-gloo", 2, [str(PROBE), str(tmp_path / "horovod")]
           + tiny(tiny_data, tmp_path / "horovod_run", *COMMON), tmp_path)
    horovod_states = final_states(tmp_path / "horovod")
    assert_bitwise_equal(horovod_states[0], horovod_states[1])
    scales = [torch.load(folder / "checkpoints" / "last.pt", weights_only=False)["scaler"]["scale"]
              for folder in (torch_dir, tmp_path / "horovod_run")]
    assert scales[0] == scales[1] < 65536.0  # the same overflows skipped the same steps on both engines
    difference = max_difference(torch_states[0], horovod_states[0])
    print(f"torch engine vs horovod engine: max |difference| {difference:g}")
    assert difference <= ATOL, f"the engines' parameters differ by up to {difference:g}"
    initial = torch.load(torch_dir / "checkpoints" / "step-00000003.pt", weights_only=False)["model"]
    assert max_difference(initial, horovod_states[0]) > 1000 * ATOL  # the steps after it moved the weights

    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copy(torch_dir / "checkpoints" / "step-00000003.pt", resumed / "checkpoints" / "last.pt")
    result = launch("horovodrun-gloo", 2, [str(PROBE), str(tmp_path / "resumed_probe")]
                    + tiny(tiny_data, resumed, *COMMON), tmp_path)
    assert "resumed from" in result.stdout and "at epoch 2, step 1/2" in result.stdout, result.stdout[-2000:]
    resumed_states = final_states(tmp_path / "resumed_probe")
    assert_bitwise_equal(resumed_states[0], resumed_states[1])
    difference = max_difference(resumed_states[0], torch_states[0])
    print(f"resumed under horovod vs uninterrupted torch: max |difference| {difference:g}")
    assert difference <= ATOL, f"resumed under Horovod differs from the uninterrupted torch run by {difference:g}"


@pytest.mark.slow  # a launch of its own on top of the torchrun run
def test_torch_engine_under_mpirun_takes_its_place_from_open_mpi(torch_run, tiny_data, tmp_path):
    # mpirun sets OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK, not torchrun's variables; the job script
    # exports rank 0's address and a port. The same run ends equal to the torchrun one.
    port = free_port()
    launch("mpirun", 2, [str(PROBE), str(tmp_path / "probe")] + tiny(tiny_data, tmp_path / "run",
                                                                      "dist.engine=torch", *COMMON),
           tmp_path, env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}, own_launch=True)
    probes = [torch.load(tmp_path / "probe" / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert [(p["rank"], p["size"], p["local_rank"]) for p in probes] == [(0, 2, 0), (1, 2, 1)]
    assert "OMPI_COMM_WORLD_RANK" in probes[1]["launcher_env"] and "RANK" not in probes[1]["launcher_env"]
    assert [p["horovod_modules"] for p in probes] == [[], []]
    assert_bitwise_equal(probes[0]["state"], probes[1]["state"])
    difference = max_difference(probes[0]["state"], torch_run[1][0]["state"])
    assert difference <= ATOL, f"mpirun and torchrun runs of the torch engine differ by {difference:g}"
