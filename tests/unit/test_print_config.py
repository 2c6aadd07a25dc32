"""``--print-config`` shows what is in effect: the keys that yield to others (train.batch_size to
train.global_batch_size, optim.base_lr to optim.lr or optim.lr_per_rank) carry a comment with what
applies instead, and the lines after the config give the batch per rank, the global batch and the
peak rate at the launch's number of ranks, or at the number assumed when not launched, said as
such. In process: nothing here launches or trains."""

import pytest
import yaml

from hvdtrain import cli
from hvdtrain.comm import launcher_env


@pytest.fixture(autouse=True)
def not_launched(monkeypatch):
    """No launcher's variables: each test sets the ones it means."""
    for name in launcher_env.RANK_VARIABLES + launcher_env.SIZE_VARIABLES + launcher_env.LOCAL_RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def printed(capsys, *argv: str) -> tuple[dict[str, str], list[str], dict]:
    """(the comment on each commented key as 'section.key', the lines after the config, the YAML)."""
    assert cli.main(["--print-config", *argv]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    comments, section, tail = {}, "", []
    for line in out.splitlines():
        if line.startswith("#"):
            tail.append(line)
            continue
        assert not tail, f"a config line after the in-effect lines: {line!r}"
        if not line.startswith(" "):
            section = line.split(":", 1)[0]
        elif "  # " in line:
            key, comment = line.strip().split("  # ", 1)
            comments[f"{section}.{key.split(':', 1)[0]}"] = comment
    return comments, tail, yaml.safe_load(out)


def test_the_preset_shows_the_batch_per_rank_and_the_rate_in_effect_not_launched(capsys):
    comments, tail, config = printed(capsys, "--config", "pytorch_examples")
    # The keys as given (the file runs at any number of ranks), each marked with what applies instead.
    assert (config["train"]["batch_size"], config["optim"]["base_lr"]) == (32, 0.1)
    assert comments == {
        "train.batch_size": "in effect: 256 per rank at 1 rank, derived from train.global_batch_size 256 / "
                            "(1 rank x 1 pass)",
        "optim.base_lr": "not in effect: optim.lr sets the rate"}
    assert tail == [
        "# In effect at 1 rank (assumed, not launched: one process; a launch's number of ranks replaces it):",
        "#   batch per rank: 256 (derived from train.global_batch_size 256 / (1 rank x 1 pass))",
        "#   global batch: 256 (train.global_batch_size)",
        "#   peak learning rate: 0.1 (optim.lr, as given, not scaled by the global batch)"]


def test_under_a_launcher_the_batch_per_rank_is_for_its_ranks(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")  # torchrun's
    comments, tail, _ = printed(capsys, "--config", "pytorch_examples")
    assert comments["train.batch_size"] == ("in effect: 64 per rank at 4 ranks, derived from "
                                            "train.global_batch_size 256 / (4 ranks x 1 pass)")
    assert tail[:2] == ["# In effect at 4 ranks (the launch's: WORLD_SIZE=4):",
                        "#   batch per rank: 64 (derived from train.global_batch_size 256 / (4 ranks x 1 pass))"]


def test_not_launched_it_assumes_the_ranks_an_explicit_batch_agrees_with(capsys):
    _, tail, config = printed(capsys, "--config", "pytorch_examples", "train.batch_size=64",
                              "train.backward_passes_per_step=2", "train.drop_last=true")
    assert config["train"]["batch_size"] == 64
    assert tail[:3] == [
        "# In effect at 2 ranks (assumed, not launched: the number at which train.batch_size=64 and "
        "train.global_batch_size=256 agree):",
        "#   batch per rank: 64 (derived from train.global_batch_size 256 / (2 ranks x 2 passes))",
        "#   global batch: 256 (train.global_batch_size)"]


def test_a_per_256_rate_is_scaled_by_the_global_batch_and_the_warm_up_shown(capsys, monkeypatch):
    monkeypatch.setenv("HOROVOD_SIZE", "4")
    comments, tail, _ = printed(capsys, "--config", "debug", "train.batch_size=128", "optim.base_lr=0.1",
                                "optim.warmup_epochs=5", "optim.warmup_start=-1", "optim.warmup_start_lr=-1")
    assert comments == {}  # nothing yields: train.batch_size and optim.base_lr are in effect
    # 0.1 per 256 images x 512 / 256 = 0.2; Goyal et al.'s warm-up starts at the per-256 rate.
    assert tail == ["# In effect at 4 ranks (the launch's: HOROVOD_SIZE=4):",
                    "#   batch per rank: 128 (train.batch_size)",
                    "#   global batch: 512 (derived: 128/rank x 4 ranks x 1 pass)",
                    "#   peak learning rate: 0.2 (derived from optim.base_lr 0.1 per 256 images x 512 / 256)",
                    "#   warm-up from: 0.1 (over 5 epochs to 0.2)"]


def test_a_rate_per_rank_is_scaled_by_the_ranks_and_passes(capsys, monkeypatch):
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    comments, tail, _ = printed(capsys, "--config", "debug", "train.batch_size=32", "optim.lr_per_rank=0.0125",
                                "train.backward_passes_per_step=2", "optim.warmup_epochs=0")
    # Horovod's example: 0.0125 x 2 ranks x 2 passes = 0.05 for the global batch of 128.
    assert comments == {"optim.base_lr": "not in effect: optim.lr_per_rank sets the rate (0.05 at 2 ranks)"}
    assert tail[2:] == ["#   global batch: 128 (derived: 32/rank x 2 ranks x 2 passes)",
                        "#   peak learning rate: 0.05 (derived from optim.lr_per_rank 0.0125 for one rank's 32 "
                        "images x 128 / 32)"]


def test_a_global_batch_the_launch_cannot_split_stops_in_one_line(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert cli.main(["--print-config", "--config", "pytorch_examples"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == ["hvdtrain: error: train.global_batch_size=256 does not divide into 3 ranks x 1 passes: "
                                "use a multiple of 3 (e.g. 255 or 258), or another number of ranks"]


def test_only_rank_0_prints_it(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert cli.main(["--print-config", "--config", "pytorch_examples"]) == 0
    assert capsys.readouterr() == ("", "")
