"""hvdtrain/distributed.py in one process: the sampler is torch's index for index (and with
``pad=False`` a partition), misuse ends in one line with exit 2, a stop signal ends the rank with
exit 75 and one line naming the last save, and a signal during a save waits until the file is whole.
Each case that starts Horovod or installs signal handlers runs in a process of its own."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch.utils.data.distributed import DistributedSampler as TorchSampler

from hvdtrain.distributed import DistributedSampler
from tests.helpers import REPO


@pytest.mark.parametrize("length", [0, 1, 7, 10, 33])
@pytest.mark.parametrize("replicas", [1, 2, 3, 8])
@pytest.mark.parametrize("shuffle,drop_last", [(True, False), (False, False), (True, True), (False, True)])
def test_the_sampler_is_torchs_index_for_index(length, replicas, shuffle, drop_last):
    data = list(range(length))
    for rank in range(replicas):
        ours = DistributedSampler(data, num_replicas=replicas, rank=rank, shuffle=shuffle, seed=5, drop_last=drop_last)
        theirs = TorchSampler(data, num_replicas=replicas, rank=rank, shuffle=shuffle, seed=5, drop_last=drop_last)
        for epoch in (0, 3):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs) and len(ours) == len(theirs), (rank, epoch)


@pytest.mark.parametrize("length,replicas", [(10, 3), (7, 8), (33, 2)])
def test_without_padding_every_sample_belongs_to_one_rank(length, replicas):
    shares = [list(DistributedSampler(list(range(length)), num_replicas=replicas, rank=rank, shuffle=False, pad=False))
              for rank in range(replicas)]
    assert sorted(i for share in shares for i in share) == list(range(length))
    assert [len(share) for share in shares] == [
        len(DistributedSampler(list(range(length)), num_replicas=replicas, rank=rank, pad=False))
        for rank in range(replicas)]


def python(code: str, tmp_path, **extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **extra}
    for name in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID", "HVDTRAIN_LAUNCH_TOKEN"):
        env.pop(name, None)
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("code,says", [
    ("dist.init_process_group('ucc')", "backend 'ucc' is not one hvdtrain knows"),
    ("dist.init_process_group('gloo', world_size=4)", "init_process_group(world_size=4): the launcher made this"),
    ("dist.get_rank()", "get_rank() needs the process group: call dist.init_process_group() first"),
    ("DDP(torch.nn.Linear(2, 2))", "DistributedDataParallel needs the process group"),
    ("dist.init_process_group(); dist.all_reduce(torch.ones(1), group=object())", "has one group, all ranks"),
    ("dist.init_process_group(); DDP(torch.nn.Linear(2, 2), compression='int8')", "give None or 'fp16'"),
])
def test_misuse_ends_in_one_line_with_exit_2(code, says, tmp_path):
    result = python(f"import torch\nimport hvdtrain.distributed as dist\n"
                    f"from hvdtrain.distributed import DistributedDataParallel as DDP\n{code}", tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and says in result.stderr, result.stderr


ONE_RANK = """
import os, signal, time, torch
import hvdtrain.distributed as dist
from hvdtrain.distributed import DistributedDataParallel as DDP
from hvdtrain.checkpoint import io
dist.init_process_group("nccl")  # accepted: Horovod picks the backend
assert (dist.get_rank(), dist.get_world_size(), os.environ["LOCAL_RANK"]) == (0, 1, "0")
model = torch.nn.Linear(3, 1)
ddp = DDP(model)
x = torch.randn(4, 3)
assert torch.equal(ddp(x), model(x))
ddp(x).sum().backward()  # one rank: the gradient is its own
t = torch.ones(2)
dist.all_reduce(t)
assert torch.equal(t, torch.ones(2))
if os.environ["WHEN"] == "during-save":
    write = io.torch.save
    def slow_save(obj, handle):  # the signal comes in the middle of the write
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        write(obj, handle)
        print("the write went on", flush=True)
    io.torch.save = slow_save
    dist.save({"weights": model.state_dict(), "epochs": 3}, "snapshot.pt")
else:
    dist.save({"weights": model.state_dict(), "epochs": 2}, "snapshot.pt")
    os.kill(os.getpid(), signal.SIGTERM)
time.sleep(5)
print("not stopped", flush=True)
"""


@pytest.mark.parametrize("when", ["after-save", "during-save"])
def test_a_stop_signal_ends_the_rank_with_75_after_any_save_under_way(when, tmp_path):
    result = python(ONE_RANK, tmp_path, WHEN=when)
    assert result.returncode == 75, result.stdout + result.stderr
    assert "not stopped" not in result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hvdtrain: rank 0 stopped by SIGTERM: run the same command to "
                                                   "resume from snapshot.pt (saved "), result.stderr
    saved = torch.load(tmp_path / "snapshot.pt", weights_only=True)
    assert saved["epochs"] == (3 if when == "during-save" else 2)
    assert ("the write went on" in result.stdout) == (when == "during-save")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["snapshot.pt"]  # no scratch file left


def test_the_stop_handlers_are_the_process_own_again_after_destroy(tmp_path):
    code = ("import signal, hvdtrain.distributed as dist\nbefore = signal.getsignal(signal.SIGTERM)\n"
            "dist.init_process_group()\nassert signal.getsignal(signal.SIGTERM) is not before\n"
            "dist.destroy_process_group()\nassert signal.getsignal(signal.SIGTERM) is before\nprint('ok')")
    result = python(code, tmp_path)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
