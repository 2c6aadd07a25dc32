"""The command line a newcomer meets: help, one-line errors that suggest the fix, and a bare run
that refuses instead of starting 90 epochs of ResNet-50. In process and fast: nothing here
trains or launches Horovod."""

import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

from hvdtrain import cli
from hvdtrain.job_config import load_config

COMMANDS = ["train", "evaluate", "bench", "bench-data", "report", "doctor", "prepare", "ray", "launch", "slurm-script"]


@pytest.fixture(autouse=True)
def rank_zero(monkeypatch):
    """Run as rank 0 even inside a launcher: other ranks wait before printing an error."""
    for key in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(key, raising=False)


@pytest.fixture
def no_training(monkeypatch):
    """A stand-in trainer that fails the test if a run gets as far as training."""
    fake = types.ModuleType("hvdtrain.train.trainer")

    def train(cfg):
        raise AssertionError("training started")

    fake.train = train
    fake.JobStopped = fake.Preempted = type("NotRaised", (Exception,), {})
    monkeypatch.setitem(sys.modules, "hvdtrain.train.trainer", fake)


def one_error_line(capsys) -> str:
    """The error printed by a failed command: exactly one line on stderr, nothing on stdout."""
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("hvdtrain: error: ")
    return lines[0].removeprefix("hvdtrain: error: ")


@pytest.mark.parametrize("argv", [["--help"], ["-h"], ["help"]])
def test_help_lists_every_command_and_how_to_train(argv, capsys):
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert f"\n  {name} " in out, f"{name} missing from the help"
    assert "train is the default" in out
    for train_usage in ("--config", "--print-config", "key=value", "--config demo", "data.dir="):
        assert train_usage in out
    assert "docs/config.md" in out


def test_version_says_the_version_and_the_install(capsys):
    import hvdtrain

    for word in ("--version", "-V"):
        assert cli.main([word]) == 0
        out = capsys.readouterr().out
        assert out == (f"hvdtrain {hvdtrain.__version__} ({Path(hvdtrain.__file__).resolve().parent}, "
                       f"Python {sys.version.split()[0]})\n"), out


def test_help_names_every_train_option():
    # The overview's train section is written by hand: it must not fall behind train_parser.
    overview = cli.overview()
    for action in cli.train_parser()._actions:
        for option in action.option_strings:
            if option not in ("-h", "--help"):
                assert option in overview, f"{option} of train_parser missing from the help"


def test_every_command_has_a_summary():
    assert list(cli.COMMANDS) == COMMANDS
    assert set(cli.SUMMARIES) == set(cli.COMMANDS)


@pytest.mark.parametrize("argv, text, code", [
    (["train", "--help"], "docs/config.md", 0),
    (["evaluate", "--help"], "--checkpoint", 0),
    (["--help-me"], "unrecognized arguments: --help-me", 2),  # an unknown option is train's, as before
])
def test_a_commands_own_argparse_still_answers(argv, text, code, capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(argv)
    out, err = capsys.readouterr()
    assert text in out + err
    assert done.value.code == code


def test_the_cli_module_imports_neither_torch_nor_horovod():
    # Help and usage errors must come at once, before the seconds torch takes to import.
    check = "import sys, hvdtrain.cli; print(sorted({'torch', 'horovod'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=60,
                            cwd=Path(__file__).resolve().parents[2])
    assert result.stdout.strip() == "[]", result.stderr


def test_help_command_shows_a_commands_help(capsys):
    assert cli.main(["help", "evaluate"]) == 0
    assert "usage: hvdtrain evaluate" in capsys.readouterr().out


@pytest.mark.parametrize("typo, command", [
    ("evalute", "evaluate"), ("benchh", "bench"), ("bench_data", "bench-data"), ("docter", "doctor"),
    ("reprot", "report"), ("trian", "train"),
])
def test_a_mistyped_command_suggests_the_nearest(typo, command, capsys):
    assert cli.main([typo, "--config", "debug"]) == 2
    assert one_error_line(capsys) == f"unknown command '{typo}' (did you mean '{command}'?)"


def test_help_for_a_mistyped_command_suggests_too(capsys):
    assert cli.main(["help", "evalute"]) == 2
    assert one_error_line(capsys) == "unknown command 'evalute' (did you mean 'evaluate'?)"


def test_a_config_name_given_as_command_points_to_config(capsys):
    assert cli.main(["demo"]) == 2
    assert one_error_line(capsys) == "unknown command 'demo' (did you mean '--config demo'?)"


def test_an_unknown_word_lists_the_commands(capsys):
    assert cli.main(["frobnicate"]) == 2
    message = one_error_line(capsys)
    assert message.startswith("unknown command 'frobnicate' (commands: train, evaluate, bench")
    assert "--help" in message


@pytest.mark.parametrize("argv, message", [
    # Train arguments need no command name: keys, files and options are never taken for one.
    (["train.epochs"], "override 'train.epochs' is not of the form section.key=value"),
    (["my.yaml"], "override 'my.yaml' is not of the form section.key=value (to read a config file, "
                  "use --config my.yaml)"),
    (["--config", "nowhere.yaml"], "config file 'nowhere.yaml' not found"),
])
def test_train_arguments_are_not_taken_for_commands(argv, message, capsys):
    assert cli.main(argv) == 2
    assert one_error_line(capsys).startswith(message)


@pytest.mark.parametrize("override, suggestion", [
    ("trian.epochs=3", "did you mean 'train.epochs'?"),
    ("train.epoch=3", "did you mean 'train.epochs'?"),
    ("batch_size=8", "did you mean 'train.batch_size'?"),
    ("train.base_lr=0.2", "did you mean 'optim.base_lr'?"),
    ("amp.enable=true", "did you mean 'amp.enabled'?"),
])
def test_a_mistyped_key_suggests_the_nearest(override, suggestion, capsys, no_training):
    assert cli.main(["--config", "debug", override]) == 2
    message = one_error_line(capsys)
    key = override.split("=")[0]
    assert message.startswith(f"unknown config key '{key}' (valid keys")
    assert message.endswith(f"; {suggestion}")


def test_a_key_with_nothing_near_lists_the_valid_keys_only(capsys):
    # (data.path would suggest data.split and data.location data.val_fraction: near keys get a suggestion)
    assert cli.main(["data.zzz=/x"]) == 2
    message = one_error_line(capsys)
    assert message.startswith("unknown config key 'data.zzz' (valid keys in 'data': augment, decoder, dir, ")
    assert "did you mean" not in message


@pytest.mark.parametrize("text, message", [
    ("train:\n  epoch: 3\n", "unknown config key 'train.epoch' (valid keys in 'train': "),
    ("trian:\n  epochs: 3\n", "unknown config key 'trian' (valid keys: "),
])
def test_a_mistyped_key_in_a_file_suggests_too(text, message, tmp_path, capsys):
    path = tmp_path / "mine.yaml"
    path.write_text(text)
    assert cli.main(["--config", str(path)]) == 2
    line = one_error_line(capsys)
    assert line.startswith(message)
    assert line.endswith("did you mean 'train.epochs'?" if "epoch:" in text else "did you mean 'train'?")


@pytest.mark.parametrize("argv", [[], ["train"], ["train.epochs=3"], ["data.dir="]])
def test_a_run_without_data_refuses_and_points_to_the_fix(argv, capsys, no_training):
    assert cli.main(argv) == 2
    message = one_error_line(capsys)
    assert message.startswith("no data chosen: ")
    assert "--config demo" in message
    assert "--config imagenet_resnet50 data.dir=/path/to/imagenet" in message


@pytest.mark.parametrize("config_file, overrides", [
    ("demo", []),                            # the demo config leaves data.dir empty on purpose
    ("debug", []),
    (None, ["data.dir=/data/imagenet"]),
    (None, ["data.synthetic=true"]),
])
def test_a_config_file_or_data_dir_is_a_choice(config_file, overrides):
    cli.require_data_choice(config_file, load_config(config_file, overrides))  # does not raise


def test_print_config_needs_no_data(capsys, no_training):
    assert cli.main(["--print-config", "train.epochs=3"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    printed = yaml.safe_load(out)
    assert printed["train"]["epochs"] == 3
    assert printed["data"]["dir"] == ""


def test_print_config_with_a_config_file(capsys):
    assert cli.main(["train", "--config", "debug", "--print-config", "optim.base_lr=0.2"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert (printed["model"]["arch"], printed["optim"]["base_lr"]) == ("resnet18", 0.2)
