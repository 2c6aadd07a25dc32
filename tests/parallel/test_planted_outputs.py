"""Jobs, for real, on a shared scratch folder where another user (sec49b, made with useradd) plants
things: her run folder (mode 777, links to the victim's files at config.yaml, metrics.jsonl,
attempts.jsonl and ranks.tsv) is refused in one line and nothing is written; a run in the victim's
own folder is private (0700 folders, 0600 files); ``evaluate`` of a checkpoint whose recorded
output.dir points into the victim's home makes no folder there. Three single-process jobs (python
-m hvdtrain, 4-5 s of CPU each): the launch is not the subject, what the job writes is. The
writers one by one: tests/unit/test_security_outputs.py; a foreign checkpoint not resumed:
tests/unit/test_security_resume.py."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
import torch

from tests import users
from tests.helpers import DEBUG, launch

pytestmark = pytest.mark.skipif(users.why_not() is not None, reason=str(users.why_not()))


def job(tmp: Path, out: Path, *extra: str, command: tuple[str, ...] = ()):
    settings = ["data.synthetic=true", "data.synthetic_samples=32", "train.steps_per_epoch=2", "train.epochs=1",
                "output.tensorboard=false", "runtime.stats_interval=0", f"output.dir={out}", *extra]
    program = ["-m", "hvdtrain", *command, *(settings if command else DEBUG + settings)]
    return launch("single", 1, program, tmp, check=False, timeout=300)


def errors(result) -> list[str]:
    return [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("hvdtrain: error")]


def private(path: Path) -> bool:
    return stat.S_IMODE(path.stat().st_mode) & 0o077 == 0


def test_planted_run_folder_refused_own_folder_private_evaluate_writes_nowhere(victim_scratch, tmp_path):
    folder, home = victim_scratch
    users.as_user(users.ATTACKER, users.PLANT.format(home=home), cwd=folder)

    refused = job(tmp_path, folder / "run")
    assert refused.returncode == 2 and len(errors(refused)) == 1, refused.stdout[-3000:] + refused.stderr[-3000:]
    assert errors(refused)[0].startswith(f"hvdtrain: error: the output folder '{folder / 'run'}' is not safe to write "
                                         f"into: {folder / 'run'} belongs to {users.ATTACKER}")
    users.untouched(home)  # nothing written through her links, nothing created there
    assert {p.lstat().st_uid for p in (folder / "run").iterdir()} == {users.user().pw_uid}

    own = home / "run"
    trained = job(tmp_path, own)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    written = [own, *own.rglob("*")]
    assert {"config.yaml", "metrics.jsonl", "attempts.jsonl", "last.pt"} <= {p.name for p in written}
    assert [p for p in written if not private(p)] == []

    # A checkpoint whose recorded output.dir points into someone's home: evaluating it makes nothing there.
    payload = torch.load(own / "checkpoints" / "last.pt", weights_only=True)
    payload["config"]["output"]["dir"] = str(home / "planted_by_ckpt")
    crafted = tmp_path / "crafted.pt"
    torch.save(payload, crafted)
    evaluated = job(tmp_path, home / "planted_by_ckpt", command=("evaluate", "--checkpoint", str(crafted)))
    assert evaluated.returncode == 0, evaluated.stdout[-3000:] + evaluated.stderr[-3000:]
    assert json.loads(evaluated.stdout.strip().splitlines()[-1])["split"] == "val"
    assert not (home / "planted_by_ckpt").exists()
