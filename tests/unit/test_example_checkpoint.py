"""Horovod's example's checkpoint (examples/pytorch/pytorch_imagenet_resnet50.py's save_checkpoint:
``torch.save({'model': model.state_dict(), 'optimizer': optimizer.state_dict()},
'checkpoint-{epoch}.pth.tar')`` after ``epoch`` epochs) continues in hvdtrain: read with
``weights_only=True``, the epoch from the file's name, the model's weights and the optimizer's
momentum moved into hvdtrain's own parameter groups, so that the next step is the step the example
would have taken; anything else in such a file is refused in one line, and nothing in it runs."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hvdtrain.checkpoint import io as checkpoint
from hvdtrain.job_config import load_config
from hvdtrain.optim.build import build_optimizer
from hvdtrain.train.resume import adopt_example, example_problem
from hvdtrain.train.state import RunState


class Tiny(torch.nn.Module):
    """A model with the parameter kinds of a ResNet: convolution, BatchNorm (weight, bias, buffers), fc."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, bias=False)
        self.bn = torch.nn.BatchNorm2d(4)
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(F.relu(self.bn(self.conv(x))).mean((2, 3)))


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(4, 3, 8, 8, generator=generator), torch.randint(0, 3, (4,), generator=generator)


def example_step(model, optimizer, seed: int, lr: float) -> None:
    """One step of the example's train(): the rate set, cross-entropy, SGD."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad()
    data, target = batch(seed)
    F.cross_entropy(model(data), target).backward()
    optimizer.step()


def example_checkpoint(folder: Path, epochs: int = 2, momentum: float = 0.9, wd: float = 5e-5) -> tuple[Path, Tiny]:
    """Two steps of the example's training, saved exactly as its save_checkpoint saves."""
    torch.manual_seed(0)
    model = Tiny()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum, weight_decay=wd)
    for seed in (1, 2):
        example_step(model, optimizer, seed, 0.1)
    path = folder / f"checkpoint-{epochs}.pth.tar"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
    return path, model


def hvdtrain_run(cfg=None, steps_per_epoch: int = 5) -> types.SimpleNamespace:
    """What resume needs of a run: a fresh model (other weights), hvdtrain's optimizer over its groups."""
    cfg = cfg or load_config("horovod_example", ["model.arch=resnet18"])
    torch.manual_seed(7)
    model = Tiny()
    optimizer = build_optimizer(model, cfg.optim, 0.1)
    return types.SimpleNamespace(cfg=cfg, state=RunState(model, optimizer), steps_per_epoch=steps_per_epoch)


def test_the_examples_checkpoint_continues_with_the_step_the_example_would_take(tmp_path):
    path, example_model = example_checkpoint(tmp_path)
    payload = checkpoint.load(path)
    assert payload["written_by"] == "horovod_example" and payload["epoch"] == 2
    run = hvdtrain_run()
    # hvdtrain's groups order the parameters otherwise than model.parameters() (matrices first).
    ours = [p for group in run.state.optimizer.param_groups for p in group["params"]]
    assert [id(p) for p in ours] != [id(p) for p in run.state.model.parameters()] and len(ours) == 5
    assert example_problem(run, (path, payload)) is None
    run.state.load_state_dict(adopt_example(run, payload, with_optimizer=True))
    assert (run.state.position.epoch, run.state.position.step, run.state.position.step_in_epoch) == (2, 10, 0)
    for name, value in example_model.state_dict().items():
        assert torch.equal(run.state.model.state_dict()[name], value), name
    # The example's next step and hvdtrain's, from the same batch at the same rate: the same weights.
    example_optimizer = torch.optim.SGD(example_model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-5)
    example_optimizer.load_state_dict(torch.load(path, weights_only=True)["optimizer"])
    example_step(example_model, example_optimizer, 3, 0.05)
    example_step(run.state.model, run.state.optimizer, 3, 0.05)
    for (name, theirs), ours in zip(example_model.named_parameters(), run.state.model.parameters()):
        assert torch.allclose(theirs, ours, rtol=0, atol=1e-7), name
    # Without the momentum (a fresh optimizer) the step differs: the test sees the optimizer's state.
    fresh = hvdtrain_run()
    fresh.state.load_state_dict(adopt_example(fresh, payload, with_optimizer=False))
    example_step(fresh.state.model, fresh.state.optimizer, 3, 0.05)
    assert not torch.allclose(fresh.state.model.conv.weight, example_model.conv.weight, rtol=0, atol=1e-6)


def test_anything_else_in_such_a_file_is_refused_in_one_line(tmp_path):
    path, model = example_checkpoint(tmp_path)
    state = torch.load(path, weights_only=True)
    cases = {
        "checkpoint-3.pth.tar": ({**state, "epoch": 3}, "holds keys epoch, model, optimizer"),
        "checkpoint-4.pth.tar": ({"model": state["model"]}, "holds keys model"),
        "checkpoint-5.pth.tar": ([state["model"]], "holds a list"),
        "weights.pth.tar": (state, "this is named weights.pth.tar"),
        "checkpoint-0.pth.tar": (state, "numbers its checkpoints from 1"),
    }
    for name, (payload, words) in cases.items():
        torch.save(payload, tmp_path / name)
        with pytest.raises(checkpoint.CheckpointError) as error:
            checkpoint.load(tmp_path / name)
        assert words in str(error.value) and "\n" not in str(error.value), (name, str(error.value))
    # hvdtrain's own checkpoint copied to the example's kind of name is still hvdtrain's.
    own = {"model": state["model"], "optimizer": state["optimizer"], "epoch": 1, "step": 4, "config": {}}
    torch.save(own, tmp_path / "checkpoint-7.pth.tar")
    assert "written_by" not in checkpoint.load(tmp_path / "checkpoint-7.pth.tar")


class Planted:
    """What a pickle can make run: with torch.load(weights_only=False) this writes a file."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "code from a checkpoint ran"))


def test_nothing_in_the_file_runs(tmp_path):
    path, _ = example_checkpoint(tmp_path)
    state = torch.load(path, weights_only=True)
    marker = tmp_path / "ran"
    torch.save({"model": state["model"], "optimizer": Planted(str(marker))}, tmp_path / "checkpoint-6.pth.tar")
    with pytest.raises(checkpoint.CheckpointError, match="is unreadable"):
        checkpoint.load(tmp_path / "checkpoint-6.pth.tar")
    assert not marker.exists()


@pytest.mark.parametrize("overrides, words", [
    (["optim.momentum=0.8"], "optim.momentum=0.9 (this run: 0.8)"),
    (["optim.weight_decay=1e-4"], "optim.weight_decay=5e-05 (this run: 0.0001)"),
    (["optim.nesterov=true"], "optim.nesterov=False (this run: True)"),
    (["optim.no_decay=ndim"], "optim.no_decay=none (this run: ndim)"),
    (["ema.decay=0.99"], "holds no EMA weights to continue: set ema.decay=0"),
])
def test_a_run_with_other_optimizer_settings_is_refused_in_one_line(tmp_path, overrides, words):
    path, _ = example_checkpoint(tmp_path)
    run = hvdtrain_run(load_config("horovod_example", ["model.arch=resnet18", *overrides]))
    problem = example_problem(run, (path, checkpoint.load(path)))
    assert problem is not None and words in problem and "\n" not in problem, problem


def test_an_optimizer_over_other_parameters_is_refused(tmp_path):
    path, _ = example_checkpoint(tmp_path)
    payload = checkpoint.load(path)
    payload["optimizer"]["param_groups"][0]["params"] = [0, 1, 2]
    problem = example_problem(hvdtrain_run(), (path, payload))
    assert "its optimizer holds 3 parameters in 1 group(s), where the example's holds this model's 5 in one" in problem


def test_evaluate_reads_it_with_the_examples_recipe(tmp_path):
    from hvdtrain.api import checkpoint_config

    path, _ = example_checkpoint(tmp_path)
    cfg = checkpoint_config(path, [f"data.dir={tmp_path}", "model.arch=resnet18"])
    assert (cfg.model.arch, cfg.seed, cfg.data.dir, cfg.optim.lr_per_rank) == ("resnet18", 42, str(tmp_path), 0.0125)
    assert cfg.data.image_size == 224 and cfg.task == "image_classification"



def test_checkpoint_resume_names_the_file_and_continues_at_the_next_epoch(tmp_path, monkeypatch, capsys):
    """resume() on one rank (the collectives as one rank's): checkpoint.resume=checkpoint-2.pth.tar
    continues at epoch 3, global step 2 x 5, with the example's weights and momentum."""
    from hvdtrain.comm import dist
    from hvdtrain.train.resume import resume

    path, example_model = example_checkpoint(tmp_path)
    for name, value in {"rank": lambda: 0, "size": lambda: 1, "broadcast_state": lambda state, root_rank=0: None,
                        "broadcast_object": lambda obj, root_rank=0, name=None: obj}.items():
        monkeypatch.setattr(dist, name, value)
    run = hvdtrain_run(load_config("horovod_example", ["model.arch=resnet18", f"checkpoint.resume={path}",
                                                       f"output.dir={tmp_path / 'run'}"]))
    run.__dict__.update(run_dir=tmp_path / "run", task=types.SimpleNamespace(checkpoint_metadata=lambda: {}),
                        global_batch=256, evaluating=False, start_epoch=0, resume_changes=None)
    resume(run)
    out = capsys.readouterr().out
    assert f"hvdtrain: resumed from {path} (Horovod's example's, after 2 epochs) at epoch 3 (global step 10)" in out
    assert "ranks" not in out  # no rescaling line: the file records no ranks
    assert run.start_epoch == 2 and run.state.position.step == 10
    assert torch.equal(run.state.model.fc.weight, example_model.fc.weight)
    momentum = {id(p): s["momentum_buffer"] for p, s in run.state.optimizer.state.items()}
    saved = torch.load(path, weights_only=True)["optimizer"]["state"]  # model.parameters() order: fc.weight is 3rd
    assert len(momentum) == 5 and torch.equal(momentum[id(run.state.model.fc.weight)], saved[3]["momentum_buffer"])
