"""What the ranks would refuse once they have built the model is refused before any rank starts, in
one line: by --print-config, by the train command before it imports Horovod, and by hvdtrain launch
before horovodrun starts a rank (train/preflight.py builds the model on the meta device)."""

from __future__ import annotations

import sys

import pytest

from hvdtrain import cli
from hvdtrain.config import ConfigError
from hvdtrain.job_config import load_config
from hvdtrain.train.preflight import check_before_launch, hvdtrain_train_args

NO_NAME = ["optim.no_decay=names", "optim.no_decay_names=bn,batchnorm"]


@pytest.fixture(autouse=True)
def rank_zero(monkeypatch):
    for key in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(key, raising=False)


def error_line(capsys) -> str:
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1, err
    return err.strip()


@pytest.mark.parametrize("overrides, words", [
    (NO_NAME, "config key 'optim.no_decay_names': 'batchnorm' is in no parameter name of this model"),
    (["model.freeze=layer9"], "config key 'model.freeze': pattern 'layer9' matches no parameter of resnet18"),
    (["checkpoint.best_metric=top3"], "config key 'checkpoint.best_metric': task 'image_classification' does "
                                      "not say whether a higher or a lower 'top3' is better"),
    (["train.target=0.5", "train.target_metric=acc"], "'train.target_metric'"),
    (["model.arch=resnet5"], "unknown torchvision model 'resnet5'"),
    (["model.arch=squeezenet1_1", "model.zero_init_residual=true"], "needs ResNet blocks"),
])
def test_print_config_refuses_what_the_ranks_would(overrides, words, capsys):
    assert cli.main(["--config", "debug", "--print-config", *overrides]) == 2
    line = error_line(capsys)
    assert line.startswith("hvdtrain: error: ") and words in line


def test_the_train_command_refuses_before_it_imports_horovod(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "hvdtrain.api", None)  # importing the trainer would fail the test
    assert cli.main(["--config", "debug", *NO_NAME]) == 2
    assert "'batchnorm' is in no parameter name" in error_line(capsys)


def test_a_valid_model_setting_passes_and_nothing_is_allocated():
    cfg = load_config("debug", ["model.arch=resnet50", "optim.no_decay=names", "optim.no_decay_names=bn",
                                "model.freeze=layer1", "optim.head_lr_mult=10"])
    check_before_launch(cfg)  # on the meta device: no memory, no initialization
    recommendation = load_config("movielens", ["optim.no_decay=names", "optim.no_decay_names=nothing"])
    check_before_launch(recommendation)  # not the image task: its model depends on its data


@pytest.mark.parametrize("program, expected", [
    (["-np", "2", "-H", "localhost:2", "python", "-m", "hvdtrain", "--config", "debug"], ["--config", "debug"]),
    (["-np", "2", "/usr/bin/python3.11", "-m", "hvdtrain", "train", "a.b=1"], ["a.b=1"]),
    (["-np", "2", "--gloo", "hvdtrain", "--config", "x.yaml"], ["--config", "x.yaml"]),
    (["-np", "2", "python", "-m", "hvdtrain", "evaluate", "--checkpoint", "x"], None),
    (["-np", "2", "python", "-m", "hvdtrain", "bench"], None),
    (["-np", "2", "python", "my_train.py", "--lr", "0.1"], None),
    (["-np", "2", "--output-filename", "hvdtrain", "python", "x.py"], None),
    (["--np=2", "-H", "a:1,b:1", "--verbose", "python3", "-m", "hvdtrain", "--print-config"], ["--print-config"]),
])
def test_the_launcher_finds_the_train_arguments_it_starts(program, expected):
    from hvdtrain.launch.horovodrun import horovodrun_command

    assert hvdtrain_train_args(horovodrun_command(program)) == expected


def test_hvdtrain_launch_refuses_before_horovodrun_starts(capsys, monkeypatch):
    import hvdtrain.launch.horovodrun as launcher

    def no_launch(*args, **kwargs):
        raise AssertionError("horovodrun started")

    monkeypatch.setattr(launcher.subprocess, "Popen", no_launch)
    code = cli.main(["launch", "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, "-m", "hvdtrain",
                     "--config", "debug", *NO_NAME])
    assert code == 2 and "'batchnorm' is in no parameter name" in error_line(capsys)


def test_hvdtrain_launch_leaves_a_task_of_ones_own_to_the_ranks(monkeypatch):
    """Its module may be importable only where the ranks run: the launcher does not import it."""
    import hvdtrain.launch.horovodrun as launcher

    class Started(Exception):
        pass

    def started(*args, **kwargs):
        raise Started

    monkeypatch.setattr(launcher.subprocess, "Popen", started)
    with pytest.raises(Started):
        launcher.main(["-np", "2", "-H", "localhost:2", sys.executable, "-m", "hvdtrain",
                       "task=only_on_the_nodes:MyTask", "data.dir=/data"])


def test_the_ray_driver_checks_the_model_too():
    from hvdtrain.launch.ray_plan import check_train_args

    with pytest.raises(ConfigError, match="'batchnorm' is in no parameter name"):
        check_train_args(["--config", "debug", *NO_NAME])


def test_print_config_of_a_good_config_still_prints_it(capsys):
    assert cli.main(["--config", "debug", "--print-config", "optim.no_decay=none"]) == 0
    assert "no_decay: none" in capsys.readouterr().out


@pytest.mark.parametrize("overrides, words", [
    # torchvision's recorded minimum: no forward needed, so the ranks' own check refuses it too
    (["model.arch=alexnet", "data.image_size=32"],
     "model.arch=alexnet does not take 32 px images (data.image_size=32): the smallest size it takes is 63 px"),
    (["model.arch=inception_v3", "data.image_size=64", "data.val_image_size=80"],
     "model.arch=inception_v3 does not take 64 px images (data.image_size=64): the smallest size it takes is 75 px"),
    (["model.arch=alexnet", "data.image_size=128", "data.val_image_size=48"],
     "(data.val_image_size=48): the smallest size it takes is 63 px"),
    (["model.arch=alexnet", "data.min_res=32", "data.max_res=128", "data.end_ramp=2", "data.image_size=128"],
     "(data.min_res=32)"),
])
def test_a_model_too_big_for_the_image_size_stops_before_launch(overrides, words, capsys):
    assert cli.main(["--config", "debug", "--print-config", *overrides]) == 2
    line = error_line(capsys)
    assert line.startswith("hvdtrain: error: ") and words in line, line
    with pytest.raises(ConfigError, match="smallest size it takes"):  # each rank's check, without a forward
        check_before_launch(load_config("debug", overrides))


def test_the_meta_forward_finds_what_no_record_says(capsys):
    # vit_b_16 takes 224 px alone (its positional embedding): recorded as a minimum, 256 px passes
    # the record and fails the forward, which then names the size that works
    overrides = ["model.arch=vit_b_16", "data.image_size=256"]
    check_before_launch(load_config("debug", overrides))  # no forward: nothing to say
    assert cli.main(["--config", "debug", "--print-config", *overrides]) == 2
    line = error_line(capsys)
    assert "model.arch=vit_b_16 does not take 256 px images (data.image_size=256; its forward says: Wrong image " \
           "height! Expected 224 but got 256!)" in line and "it takes is 224 px; set data.image_size=224" in line, line


@pytest.mark.parametrize("overrides", [["model.arch=resnet18", "data.image_size=32"],
                                       ["model.arch=alexnet", "data.image_size=63"]])
def test_a_model_that_takes_the_size_passes(overrides, capsys):
    assert cli.main(["--config", "debug", "--print-config", *overrides]) == 0
    assert "arch: " in capsys.readouterr().out
