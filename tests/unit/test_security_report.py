"""``hvdtrain report`` reads anyone's metrics.jsonl but writes its PNG and summary only into a folder
of the user's, never through a planted link, privately; a metrics.jsonl without samples_per_sec,
or with a record that is not one, is a summary or one line, never a traceback."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from hvdtrain.cli import main
from hvdtrain.observe import rank_logs
from hvdtrain.ownership import UnsafePath
from hvdtrain.tools import report
from tests import users


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def metrics_without_speed(run: Path, lines: int) -> None:
    run.mkdir(parents=True, exist_ok=True)
    record = {"split": "train", "epoch": 0, "loss": 1.0, "top1": 10.0, "lr": 0.1}
    with open(run / "metrics.jsonl", "w") as handle:
        for epoch in range(lines):
            handle.write(json.dumps({**record, "epoch": epoch}) + "\n")


def test_report_writes_into_no_one_elses_folder(victim_scratch, capsys):
    folder, home = victim_scratch
    users.as_user(users.ATTACKER, users.PLANT.format(home=home), cwd=folder)
    users.as_user(users.ATTACKER, 'echo \'{"split": "train", "epoch": 0, "loss": 1.0, "top1": 5.0}\' '
                                  '> run/metrics.real && rm run/metrics.jsonl && mv run/metrics.real run/metrics.jsonl',
                  cwd=folder)
    assert main(["report", str(folder / "run")]) == 2
    err = capsys.readouterr().err
    assert err == (f"hvdtrain: error: the report folder '{folder / 'run'}' is not safe to write into: {folder / 'run'} "
                   f"belongs to {users.ATTACKER} (owner {users.ATTACKER}, mode 0777); write the report to a folder of "
                   f"yours with --out /a/folder/of/yours/report.png\n")
    users.untouched(home)
    mine = home / "reports"
    assert main(["report", str(folder / "run"), "--out", str(mine / "report.png")]) == 0  # reading hers is fine
    assert mode(mine / "report.png") == mode(mine / "summary.txt") == 0o600 and mode(mine) == 0o700


def test_report_on_metrics_without_a_speed_has_no_traceback(tmp_path, capsys):
    metrics_without_speed(tmp_path / "run", 200)
    assert main(["report", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "train: last epoch loss 1.0000, top-1 10.00%; no throughput recorded" in out
    (tmp_path / "run" / "metrics.jsonl").write_text('{"split": "train", "epoch": "x"}\n')
    assert main(["report", str(tmp_path / "run")]) == 2
    assert "metrics.jsonl:1 is not a metrics record" in capsys.readouterr().err


def test_the_report_replaces_a_planted_link_in_ones_own_folder(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("the victim's notes\n")
    metrics_without_speed(tmp_path / "run", 2)
    (tmp_path / "run" / "summary.txt").symlink_to(victim)
    (tmp_path / "run" / "report.png").symlink_to(victim)
    assert main(["report", str(tmp_path / "run")]) == 0
    assert victim.read_text() == "the victim's notes\n"
    assert not (tmp_path / "run" / "report.png").is_symlink()
    (tmp_path / "run").chmod(0o777)
    with pytest.raises(UnsafePath, match="run chmod go-w"):
        report.report_folder(tmp_path / "run" / "report.png", given=False)


def test_an_oversized_metrics_file_is_one_line_not_a_memory_error(victim_scratch, capsys):
    """Another user's run folder holds a 64 GiB sparse metrics.jsonl (no blocks on disk): refused before
    a byte is read, in one line; so is an oversized metrics_ranks.jsonl beside real metrics."""
    folder, home = victim_scratch
    users.as_user(users.ATTACKER, "mkdir -m 755 run && truncate -s 64G run/metrics.jsonl", cwd=folder)
    out = home / "reports" / "report.png"
    assert main(["report", str(folder / "run"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == (f"hvdtrain: error: {folder / 'run' / 'metrics.jsonl'} holds more than 256 MiB ({64 << 30} bytes), "
                   f"far more than a run writes there (a few hundred bytes an epoch): damaged, sparse or not "
                   f"hvdtrain's; nothing of it was read\n")
    mine = home / "run"
    metrics_without_speed(mine, 3)
    with open(mine / "metrics_ranks.jsonl", "wb") as handle:
        handle.truncate((1 << 30) + 1)
    assert main(["report", str(mine), "--out", str(out)]) == 2
    assert "metrics_ranks.jsonl holds more than 1024 MiB" in capsys.readouterr().err
    assert not out.exists()


def test_metrics_are_read_as_a_bounded_stream(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"epoch": 0}\n' * 3)  # 39 bytes
    assert [number for number, _ in report.stream_lines(path, 39)] == [1, 2, 3]
    with pytest.raises(rank_logs.TooLarge):
        next(report.stream_lines(path, 38))  # refused before the first line
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(FileNotFoundError):  # not a regular file; the open does not block
        next(report.stream_lines(tmp_path / "fifo", 39))
