"""A DDP script that keeps its own loop, on hvdtrain (hvdtrain/distributed.py), on 2 real ranks.

The DDP wrapper's semantics under horovodrun (Gloo) and mpirun: rank 0's parameters and buffers
everywhere, each gradient the average over the ranks of each rank's own (``no_sync`` micro-batches
summed first), a parameter without a gradient sent as zeros, float16 compression within its
precision; the collectives in place with torch's signatures. Then examples/from_ddp: the DDP script
(torchrun) and its port (``hvdtrain launch``) print the same validation line every epoch, the port
changes at most 20 lines counting both sides of ``diff``, and SIGTERM then the same command again
ends bitwise where an uninterrupted run ends."""

from __future__ import annotations

import re
import subprocess

import pytest
import torch

from tests.helpers import BIN, JOB_TIMEOUT, REPO, assert_bitwise_equal, job_env, launch

EXAMPLE = REPO / "examples" / "from_ddp"
DDP, PORT = EXAMPLE / "ddp_digits.py", EXAMPLE / "own_loop_digits.py"
MAX_CHANGED = 20

PROBE = """
import os, sys
import torch
import hvdtrain.distributed as dist
from hvdtrain.distributed import DistributedDataParallel as DDP

compression = sys.argv[1] if len(sys.argv) > 1 else None
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == (str(rank), str(world))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 3)
        self.unused = torch.nn.Linear(2, 2)
        self.register_buffer("seen", torch.full((2,), float(rank)))
        self.register_buffer("count", torch.tensor(rank))

    def forward(self, x):
        return self.a(x)


def flat(module):
    return torch.cat([t.detach().reshape(-1).double() for t in [*module.parameters(), *module.buffers()]])


torch.manual_seed(rank)  # each rank starts from its own weights: the wrapper makes them rank 0's
model = Net()
ddp = DDP(model, compression=compression)
everyone = [torch.zeros_like(flat(model)) for _ in range(world)]
dist.all_gather(everyone, flat(model))
assert all(torch.equal(mine, everyone[0]) for mine in everyone)
assert torch.equal(model.seen, torch.zeros(2)) and int(model.count) == 0
assert list(ddp.state_dict())[0].startswith("module.")

# Two micro-batches per rank, the first under no_sync: each gradient is the average over the ranks
# of each rank's own sum over its two.
torch.manual_seed(100 + rank)
batches = [torch.randn(5, 4) for _ in range(2)]
reference = Net()
reference.load_state_dict(model.state_dict())
for x in batches:
    reference(x).pow(2).mean().backward()
with ddp.no_sync():
    ddp(batches[0]).pow(2).mean().backward()
assert model.unused.weight.grad is None
model.seen.fill_(float(rank + 7))  # rank 0's buffers again before the next training forward
ddp(batches[1]).pow(2).mean().backward()
assert torch.equal(model.seen, torch.full((2,), 7.0))
own = reference.a.weight.grad
grads = [torch.zeros_like(own) for _ in range(world)]
dist.all_gather(grads, own)
expected = sum(grads) / world
tolerance = 1e-6 if compression is None else 2e-3 * float(expected.abs().max())
assert (model.a.weight.grad - expected).abs().max() <= tolerance, (model.a.weight.grad, expected)
assert not torch.equal(own, expected)  # the ranks' data differ: averaging changed something
assert torch.equal(model.unused.weight.grad, torch.zeros(2, 2))  # no gradient anywhere: zeros, sent

# A step keeps the ranks equal.
torch.optim.SGD(model.parameters(), lr=0.1).step()
everyone = [torch.zeros_like(flat(model)) for _ in range(world)]
dist.all_gather(everyone, flat(model))
assert all(torch.equal(mine, everyone[0]) for mine in everyone)

# The collectives, in place, with torch's signatures.
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
assert t.item() == world * (world + 1) / 2
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t, op=dist.ReduceOp.MAX)
assert t.item() == world
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t, op=dist.ReduceOp.AVG, async_op=True).wait()
assert t.item() == (world + 1) / 2
b = torch.tensor([rank])
dist.broadcast(b, src=world - 1)
assert b.item() == world - 1
objects = [None] * world
dist.all_gather_object(objects, {"rank": rank})
assert objects == [{"rank": r} for r in range(world)]
listed = ["only rank 0's" if rank == 0 else None]
dist.broadcast_object_list(listed, src=0)
assert listed == ["only rank 0's"]
dist.barrier()
sys.stdout.write(f"rank {rank} of {world}: ok\\n")  # one write: mpirun may interleave print()'s two
sys.stdout.flush()
dist.destroy_process_group()
"""


@pytest.mark.parametrize("kind,compression", [("horovodrun-gloo", None), ("mpirun", None), ("mpirun", "fp16")])
def test_the_wrapper_averages_gradients_as_ddp_does(kind, compression, tmp_path):
    result = launch(kind, 2, ["-c", PROBE] + ([compression] if compression else []), tmp_path, timeout=300)
    output = result.stdout + result.stderr
    assert sorted(re.findall(r"rank (\d) of 2: ok", output)) == ["0", "1"], output[-3000:]


def test_the_port_changes_at_most_20_lines_on_both_sides_of_diff():
    out = subprocess.run(["diff", str(DDP), str(PORT)], capture_output=True, text=True).stdout.splitlines()
    written, dropped = sum(line.startswith(">") for line in out), sum(line.startswith("<") for line in out)
    assert 0 < written + dropped <= MAX_CHANGED, out
    # Only the docstring, the imports and the save: the loop, the sampler calls, the evaluation, the
    # resume and the snapshot's contents are the DDP script's own lines.
    changed = [line[2:] for line in out if line[:1] in "<>"]
    code = [line for line in changed if not line.startswith((" ", '"""', "resumes"))]
    assert all(re.match(r"(import|from) ", line) for line in code), code
    assert [line.split("(")[0].strip() for line in changed if line.startswith(" ")][-2:] == \
        ["torch.save", "dist.save"]
    guide = (REPO / "docs" / "from-ddp.md").read_text()
    assert f"{written + dropped} lines on both sides of `diff`" in guide


def launcher(*args: str) -> list[str]:
    return [str(BIN / "python"), "-m", "hvdtrain", "launch", "-np", "2", "-H", "localhost:2", "--gloo",
            str(BIN / "python"), str(PORT), "--epochs", "10", *args]


def run(command: list[str], cwd) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=cwd, env=job_env(cwd), capture_output=True, text=True, timeout=JOB_TIMEOUT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def val_lines(output: str) -> list[tuple[float, float]]:
    return [(float(loss), float(accuracy)) for loss, accuracy in
            re.findall(r"epoch \d+ \| val loss ([0-9.]+) \| val accuracy ([0-9.]+)%$", output, re.M)]


@pytest.mark.slow
def test_the_port_matches_ddp_and_a_stopped_run_resumes_bitwise(tmp_path):
    ddp = run([str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", str(DDP), "--epochs", "10",
               "--snapshot", str(tmp_path / "ddp.pt")], tmp_path)
    whole = run(launcher("--snapshot", str(tmp_path / "whole.pt")), tmp_path)
    ddp_val, port_val = val_lines(ddp.stdout), val_lines(whole.stdout)
    assert len(ddp_val) == len(port_val) == 10, whole.stdout[-2000:]
    # The same weights, samples, batches and averaged gradients (measured: every line equal to the
    # digits printed); the sums' order differs (Horovod's allreduce against DDP's buckets).
    for (ddp_loss, ddp_accuracy), (loss, accuracy) in zip(ddp_val, port_val):
        assert loss == pytest.approx(ddp_loss, abs=2e-3) and accuracy == pytest.approx(ddp_accuracy, abs=0.6)
    assert port_val[-1][1] > 90
    # SIGTERM to the launcher once epoch 3's line shows (hvdtrain launch passes it on to every rank):
    # one line from rank 0 naming the snapshot, exit 75; the same command again ends where the whole
    # run ended.
    snapshot = tmp_path / "stopped.pt"
    job = subprocess.Popen(launcher("--snapshot", str(snapshot)), cwd=tmp_path, env=job_env(tmp_path),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in job.stdout:
            lines.append(line)
            if "epoch 3 |" in line:
                job.send_signal(subprocess.signal.SIGTERM)
                break
        rest, _ = job.communicate(timeout=120)
    finally:
        job.kill()
    output = "".join(lines) + rest
    assert job.returncode == 75, output[-3000:]
    said = [line for line in output.splitlines() if "hvdtrain: rank 0 stopped by SIGTERM" in line]
    assert len(said) == 1 and str(snapshot) in said[0], output[-3000:]
    assert "Traceback" not in output
    assert output.rstrip().splitlines()[-1].startswith("hvdtrain launch: exit 75"), output[-1000:]
    # Rank 0 prints an epoch's line before it saves that epoch: the signal may come between the two.
    stopped_at = torch.load(snapshot, weights_only=True)["epochs"]
    assert 2 <= stopped_at < 10
    run(launcher("--snapshot", str(snapshot)), tmp_path)
    final = [torch.load(path, weights_only=True) for path in (tmp_path / "whole.pt", snapshot)]
    assert final[0]["epochs"] == final[1]["epochs"] == 10
    assert_bitwise_equal(final[0]["model"], final[1]["model"])
    momentum = [{key: value["momentum_buffer"] for key, value in f["optimizer"]["state"].items()} for f in final]
    assert_bitwise_equal(momentum[0], momentum[1])
