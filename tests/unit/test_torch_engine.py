"""dist.engine=torch without a launcher: what it refuses (one line each), the distributed
optimizer's protocol with numbers (comm/torch_optimizer.py over fake collectives: which tensors go
out, when, and what comes back), and a world-size-1 training in a fresh process that imports no
Horovod. The two-rank runs against the Horovod engine are tests/parallel/test_engines.py's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from hvdtrain.comm.torch_optimizer import TOO_MANY_PASSES, GradientAverager
from hvdtrain.config import ConfigError
from hvdtrain.config.checks import HOROVOD_ONLY, horovod_only
from hvdtrain.job_config import load_config
from tests.helpers import REPO

# A value of each Horovod-only setting that asks for Horovod: one per entry of HOROVOD_ONLY.
ASKING = {
    "elastic.enabled": "true", "runtime.timeline": "/tmp/timeline.json", "dist.stall_shutdown_seconds": "120",
    "dist.op": "adasum", "dist.gradient_predivide_factor": "2",
}


def test_every_horovod_only_setting_is_tested():
    assert [only.key for only in HOROVOD_ONLY] == list(ASKING)


@pytest.mark.parametrize("key", list(ASKING))
def test_horovod_only_settings_are_refused_under_the_torch_engine_in_one_line(key):
    override = f"{key}={ASKING[key]}"
    load_config("debug", [override])  # the Horovod engine takes it
    with pytest.raises(ConfigError) as caught:
        load_config("debug", ["dist.engine=torch", override])
    message = str(caught.value)
    feature = next(only.feature for only in HOROVOD_ONLY if only.key == key)
    assert "\n" not in message and f"'{key}' needs {feature}," in message and "set dist.engine=horovod" in message


def test_the_torch_engine_refuses_at_init_from_the_same_list(monkeypatch):
    """A caller that skips the config (dist.init directly) meets the same line, from the same list."""
    from hvdtrain.comm import dist

    monkeypatch.setattr(dist, "_engine", None)  # an earlier test in this process may run the Horovod engine

    for argument, key in (("elastic", "elastic.enabled"), ("timeline", "runtime.timeline"),
                          ("stall_shutdown_seconds", "dist.stall_shutdown_seconds")):
        with pytest.raises(ConfigError) as caught:
            dist.init(gpu=False, engine="torch", **{argument: 60 if argument.startswith("stall") else True})
        feature = next(only.feature for only in HOROVOD_ONLY if only.key == key)
        assert str(caught.value) == horovod_only(key, feature)
    assert not dist.initialized()


def test_the_docs_table_of_horovod_only_settings_is_the_codes_list():
    text = (REPO / "docs" / "launching.md").read_text(encoding="utf-8")
    table = text.split("| setting | needs |\n| --- | --- |\n", 1)[1].split("\n\n", 1)[0]
    rows = [tuple(cell.strip() for cell in line.strip("|").split("|")) for line in table.splitlines()]
    assert rows == [(f"`{only.setting}`", only.feature) for only in HOROVOD_ONLY]


def test_sparse_gradients_under_the_torch_engine_need_sparse_as_dense():
    sparse = ["task=recommendation", "model.arch=mf", "recommendation.sparse_embeddings=true", "optim.weight_decay=0"]
    with pytest.raises(ConfigError) as caught:
        load_config(None, sparse + ["dist.engine=torch"])
    assert "\n" not in str(caught.value) and "dist.sparse_as_dense=true" in str(caught.value)
    assert load_config(None, sparse + ["dist.engine=torch", "dist.sparse_as_dense=true"]).dist.engine == "torch"


def test_an_unknown_engine_names_the_choices():
    with pytest.raises(ConfigError, match="dist.engine.*horovod, torch"):
        load_config("debug", ["dist.engine=mpi"])


def test_torchrun_with_the_horovod_engine_stops_in_one_line(monkeypatch):
    from hvdtrain.comm import launcher_env

    monkeypatch.delenv("HOROVOD_RANK", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("WORLD_SIZE", "2")
    problem = launcher_env.torchrun_problem("horovod")
    assert problem and "\n" not in problem and "add dist.engine=torch" in problem
    assert launcher_env.torchrun_problem("torch") is None
    monkeypatch.setenv("WORLD_SIZE", "1")  # a single process under torchrun is one job either way
    assert launcher_env.torchrun_problem("horovod") is None


def test_the_torch_engine_under_srun_or_mpirun_needs_master_addr_and_port(monkeypatch):
    from hvdtrain.comm import torch_engine

    for key in list(os.environ):
        if key.startswith(("RANK", "WORLD_SIZE", "MASTER_", "OMPI_", "PMI", "HOROVOD_", "SLURM_")):
            monkeypatch.delenv(key)
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert not torch_engine.initialized()
    with pytest.raises(ConfigError) as caught:
        torch_engine.init(gpu=False)
    message = str(caught.value)
    assert "\n" not in message and message.startswith("dist.engine=torch needs MASTER_ADDR (") and "srun" in message
    assert not torch_engine.initialized()


class TwoRanks:
    """Fake collectives of a two-rank job whose other rank sends ``other`` (the same value for every
    element): ``start`` records what goes out, ``wait`` averages it with the other rank's in the
    tensor's own dtype (as a float16 allreduce does)."""

    def __init__(self, other: float = 1.0):
        self.other, self.sent, self.waited = other, [], 0

    def start(self, tensor: torch.Tensor, op: str, name: str):
        assert op == "average"
        self.sent.append((name, tensor.dtype, tensor.clone()))
        return tensor

    def wait(self, tensor: torch.Tensor) -> torch.Tensor:
        self.waited += 1
        return tensor.add_(torch.full_like(tensor, self.other)).div_(2)


def model_and_optimizer(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.5)


def averaged(model, optimizer, ranks: TwoRanks, passes: int = 1, fp16: bool = False, bucket_mb: float = 0):
    return GradientAverager(optimizer, list(model.named_parameters()), fp16=fp16, passes=passes, bucket_mb=bucket_mb,
                            sparse_as_dense=False, start=ranks.start, wait=ranks.wait)


def test_accumulated_passes_go_out_once_on_the_last_pass_and_come_back_averaged():
    inputs = [torch.randn(5, 3, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    reference, _ = model_and_optimizer()
    for x in inputs:
        (reference(x).pow(2).mean() / 2).backward()
    model, optimizer = model_and_optimizer()
    ranks = TwoRanks(other=1.0)
    averager = averaged(model, optimizer, ranks, passes=2)
    (model(inputs[0]).pow(2).mean() / 2).backward()
    assert ranks.sent == []  # the first of two passes keeps its gradients on the rank
    (model(inputs[1]).pow(2).mean() / 2).backward()
    # one bucket per parameter, sent in backward order (the last layer's first) as each is ready
    assert [name for name, _, _ in ranks.sent] == [f"hvdtrain.grad.{i}" for i in range(4)]
    assert torch.equal(ranks.sent[0][2], reference[2].bias.grad)
    averager.synchronize()
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        assert torch.equal(mine.grad, (theirs.grad + 1) / 2)
    with averager.skip_synchronize():
        optimizer.step()
    assert len(ranks.sent) == 4 and ranks.waited == 4  # step() inside skip_synchronize sends nothing again
    with torch.no_grad():
        expected = [theirs - 0.5 * (theirs.grad + 1) / 2 for theirs in reference.parameters()]
    assert all(torch.equal(p, e) for p, e in zip(model.parameters(), expected))


def test_step_without_synchronize_synchronizes_and_a_missing_gradient_goes_as_zeros():
    model, optimizer = model_and_optimizer()
    ranks = TwoRanks(other=3.0)
    averaged(model, optimizer, ranks, bucket_mb=1.0)  # one bucket for all four parameters
    model[2](torch.ones(1, 4)).sum().backward()  # the first layer gets no gradient on this rank
    assert ranks.sent == []  # its bucket waits for the missing gradients
    first_weight = model[0].weight.detach().clone()
    optimizer.step()  # Horovod's step(): synchronize first
    assert len(ranks.sent) == 1 and ranks.sent[0][2].numel() == sum(p.numel() for p in model.parameters())
    assert torch.equal(model[0].weight.grad, torch.full_like(first_weight, 1.5))  # (0 + 3) / 2
    assert torch.equal(model[0].weight.detach(), first_weight - 0.5 * 1.5)


def test_fp16_compression_sends_float16_and_averages_in_float16():
    model, optimizer = model_and_optimizer()
    ranks = TwoRanks(other=1e-4)
    averager = averaged(model, optimizer, ranks, fp16=True)
    model(torch.randn(5, 3)).sum().backward()
    local = [p.grad.clone() for p in model.parameters()]
    averager.synchronize()
    assert {dtype for _, dtype, _ in ranks.sent} == {torch.float16}
    for p, grad in zip(model.parameters(), local):
        expected = (grad.half() + torch.full_like(grad.half(), 1e-4)).div(2).float()
        assert p.grad.dtype == torch.float32 and torch.equal(p.grad, expected)


def test_more_backward_passes_than_declared_stop_as_horovod_does():
    model, optimizer = model_and_optimizer()
    averaged(model, optimizer, TwoRanks(), passes=1)
    model(torch.randn(2, 3)).sum().backward()
    with pytest.raises(AssertionError, match="backward_passes_per_step"):
        model(torch.randn(2, 3)).sum().backward()
    assert "Increase backward_passes_per_step" in TOO_MANY_PASSES


WORLD_OF_ONE = textwrap.dedent('''
    import json, sys
    from pathlib import Path
    import torch
    import hvdtrain
    from hvdtrain.api import run_training
    from hvdtrain.comm import dist
    from hvdtrain.config import ConfigError
    from hvdtrain.data.demo import generate
    from hvdtrain.job_config import load_config

    root = Path(sys.argv[1])
    generate(root / "data", train_per_class=6, val_per_class=2, size=32, num_classes=4)
    cfg = load_config("debug", [f"data.dir={root / 'data'}", f"output.dir={root / 'run'}", "dist.engine=torch",
                                "train.epochs=1", "train.steps_per_epoch=2", "train.batch_size=4"])
    run, metrics = run_training(cfg)
    out = {"engine": dist.engine(), "size": dist.size(), "rank": dist.rank(), "local_size": dist.local_size(),
           "cross_size": dist.cross_size(), "steps": run.state.position.step, "samples": metrics["train"]["samples"]
           if "train" in metrics else None,
           "sum": dist.allreduce_sum(torch.tensor([2.5])).tolist(),
           "gathered": dist.allgather(torch.arange(3)).tolist(),
           "objects": dist.allgather_object({"a": 1}), "broadcast": dist.broadcast_object([1, "x"]),
           "checkpoint": (root / "run" / "checkpoints" / "last.pt").exists()}
    try:
        dist.join()
    except ConfigError as error:
        out["join"] = str(error)
    dist.barrier()
    out["horovod_modules"] = sorted(name for name in sys.modules if name == "horovod" or name.startswith("horovod."))
    print("RESULT " + json.dumps(out, default=str))
''')


def test_a_world_of_one_trains_under_the_torch_engine_without_a_launcher_or_horovod(tmp_path):
    env = {key: value for key, value in os.environ.items() if not key.startswith(
        ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_", "OMPI_", "PMI", "SLURM_", "HOROVOD_"))}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", HVDTRAIN_CACHE=str(tmp_path / "cache"))
    result = subprocess.run([sys.executable, "-c", WORLD_OF_ONE, str(tmp_path)], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = json.loads(result.stdout.split("RESULT ", 1)[1])
    assert out["horovod_modules"] == []  # import hvdtrain and a whole training: no Horovod module loaded
    assert (out["engine"], out["size"], out["rank"], out["local_size"], out["cross_size"]) == ("torch", 1, 0, 1, 1)
    assert out["steps"] == 2 and out["samples"] == 8 and out["checkpoint"]  # 2 steps x 4 images
    assert out["sum"] == [2.5] and out["gathered"] == [0, 1, 2]
    assert out["objects"] == [{"a": 1}] and out["broadcast"] == [1, "x"]
    assert "\n" not in out["join"] and "dist.engine=horovod" in out["join"]


class NoHorovod:
    """A finder that answers every ``horovod`` import as a Python without the package does."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "horovod":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


def test_the_horovod_engine_without_horovod_is_one_line(monkeypatch):
    from hvdtrain.comm import dist
    from hvdtrain.comm.launcher_env import NO_HOROVOD, horovod_missing

    for name in [name for name in sys.modules if name.split(".")[0] == "horovod"
                 or name == "hvdtrain.comm.horovod_engine"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delattr(sys.modules["hvdtrain.comm"], "horovod_engine", raising=False)  # else `from . import` takes it
    monkeypatch.setattr(sys, "meta_path", [NoHorovod(), *sys.meta_path])
    assert horovod_missing()
    with pytest.raises(ConfigError) as refused:
        dist._load("horovod")
    assert str(refused.value) == NO_HOROVOD
    assert "dist.engine=torch" in NO_HOROVOD and "make setup" in NO_HOROVOD
    monkeypatch.undo()
    assert not horovod_missing()  # this test environment has Horovod
