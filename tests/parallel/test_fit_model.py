"""The short path on 2 ranks: examples/from_ddp's digits DDP script (torchrun) and its hvdtrain port
(horovodrun, ``hvdtrain.fit_model``) reach the same accuracy; the port writes at most 20 lines;
SIGTERM then a rerun resumes to the same final state as an uninterrupted run; a rerun of the
finished run says so in one line with its metrics. benchmarks/ddp_port.py runs and counts its work."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import torch

from tests.helpers import (
    BIN,
    JOB_TIMEOUT,
    REPO,
    assert_bitwise_equal,
    job_env,
    launch,
    read_metrics,
    stopped_by_sigterm,
)

EXAMPLE = REPO / "examples" / "from_ddp"
DDP, PORT = EXAMPLE / "ddp_digits.py", EXAMPLE / "hvdtrain_digits.py"
MAX_CHANGED = 20  # lines the port writes or edits (docs/from-ddp.md: how they are counted)


def changed_lines() -> tuple[int, int]:
    """(lines of the port that are not the DDP script's, lines of the DDP script the port drops), as
    ``diff ddp_digits.py hvdtrain_digits.py`` prints them (``>`` and ``<``)."""
    out = subprocess.run(["diff", str(DDP), str(PORT)], capture_output=True, text=True).stdout.splitlines()
    return sum(line.startswith(">") for line in out), sum(line.startswith("<") for line in out)


def test_the_port_changes_at_most_20_lines():
    written, dropped = changed_lines()
    assert 0 < written <= MAX_CHANGED, (written, dropped)
    # What it drops is the DDP plumbing hvdtrain brings: no line that defines the data or the model.
    dropped_text = subprocess.run(["diff", str(DDP), str(PORT)], capture_output=True, text=True).stdout
    assert "class Net" not in dropped_text and "def digits_datasets" not in dropped_text
    readme = (REPO / "docs" / "from-ddp.md").read_text()
    assert f"{written} lines written" in readme and f"{dropped} dropped" in readme  # the docs give the count


def port(out, epochs: int = 10) -> list[str]:
    return [str(PORT), "--epochs", str(epochs), "--batch-size", "64", "--out", str(out)]


def run_ddp_reference(tmp_path: Path) -> subprocess.CompletedProcess:
    """The DDP script under torchrun, from scratch, up to 3 times while a rank aborts in torch's own
    teardown: "terminate called without an active exception" (SIGABRT) in rank 1 after all 10
    epochs, while rank 0 was still saving. Seen in both fresh-clone runs of 2026-11-28, where the
    image build ran beside the suite, and in none of 8 runs beside a CPU hog or of the runs without
    the build. The script is the reference here, not the code under test. Each try has its own
    snapshot: the script resumes from one it finds, and would then train nothing."""
    for attempt in range(3):
        command = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", str(DDP), "--epochs", "10",
                   "--snapshot", str(tmp_path / f"snapshot-{attempt}.pt")]
        ddp = subprocess.run(command, cwd=tmp_path, env=job_env(tmp_path), capture_output=True, text=True,
                             timeout=JOB_TIMEOUT)
        if ddp.returncode == 0 or "terminate called without an active exception" not in ddp.stderr:
            break
    return ddp


@pytest.mark.slow
def test_the_port_matches_ddp_resumes_exactly_and_says_when_it_had_finished(tmp_path):
    ddp = run_ddp_reference(tmp_path)
    assert ddp.returncode == 0, ddp.stdout[-3000:] + ddp.stderr[-3000:]
    ddp_val = [(float(loss), float(accuracy)) for loss, accuracy in
               re.findall(r"^epoch \d+ \| val loss ([0-9.]+) \| val accuracy ([0-9.]+)%$", ddp.stdout, re.M)]
    whole = tmp_path / "whole"
    result = launch("horovodrun-gloo", 2, port(whole), tmp_path)
    val = [r for r in read_metrics(whole) if r["split"] == "val"]
    assert len(ddp_val) == len(val) == 10
    assert val[-1]["samples"] == 360  # every validation sample once, over both ranks
    # The same initial model, sample order, batches and optimizer: the accuracy is the DDP script's
    # (measured: every epoch's val loss and accuracy equal to the 4 and 2 decimals it prints).
    assert val[-1]["accuracy"] > 90 and val[-1]["accuracy"] == pytest.approx(ddp_val[-1][1], abs=1.0)
    assert val[-1]["loss"] == pytest.approx(ddp_val[-1][0], abs=0.01)
    # The epoch line shows the accuracy; the start-up line both batch sizes and the constant rate.
    assert re.search(r"epoch 10/10  train loss [0-9.]+ \| val loss [0-9.]+, val accuracy [0-9.]+%", result.stdout), \
        result.stdout[-2000:]
    assert "global batch 64 (train.global_batch_size) = 32/rank x 2 ranks" in result.stdout
    assert "lr 0.05, no warm-up, constant schedule" in result.stdout
    # Run again: nothing to train, one line that it had finished, with the final metrics.
    again = launch("horovodrun-gloo", 2, port(whole), tmp_path)
    finished = [line for line in again.stdout.splitlines() if "this run had finished" in line]
    assert len(finished) == 1, again.stdout[-3000:]
    assert f"epoch 10: val accuracy {val[-1]['accuracy']:.4g}, val loss {val[-1]['loss']:.4g}" in finished[0]
    # SIGTERM to both ranks in epoch 3 under hvdtrain launch: a checkpoint, exit 75; the same command
    # again resumes and ends bitwise where the uninterrupted run ended.
    stopped = tmp_path / "stopped"
    launcher = [str(BIN / "python"), "-m", "hvdtrain", "launch", "-np", "2", "-H", "localhost:2", "--gloo",
                str(BIN / "python"), *port(stopped)]
    code, output = stopped_by_sigterm(launcher, stopped, "epoch 2/10 ", tmp_path)
    assert code == 75, output[-3000:]
    assert "stopped by SIGTERM" in output and "Traceback" not in output
    resumed = subprocess.run(launcher, cwd=tmp_path, env=job_env(tmp_path), capture_output=True, text=True,
                             timeout=JOB_TIMEOUT)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    final = [torch.load(folder / "checkpoints" / "last.pt", weights_only=True) for folder in (whole, stopped)]
    assert_bitwise_equal(final[0]["model"], final[1]["model"])
    assert [r["loss"] for r in read_metrics(stopped) if r["split"] == "val"][-1] == val[-1]["loss"]


def test_the_benchmark_runs_every_contender_and_counts_their_work(tmp_path):
    result = subprocess.run([str(BIN / "python"), str(REPO / "benchmarks" / "ddp_port.py"), "--pairs", "1",
                             "--epochs", "2", "--out", str(tmp_path)], cwd=tmp_path, env=job_env(tmp_path),
                            capture_output=True, text=True, timeout=JOB_TIMEOUT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((tmp_path / "ddp_port.json").read_text())
    ddp, hvd, own = (summary["runs"][name][0] for name in ("ddp", "hvdtrain", "own-loop"))
    assert ddp["epochs"] == hvd["epochs"] == own["epochs"] == 2
    assert hvd["train_samples"] == 2 * 22 * 64  # 1437 samples: 22 full global batches of 64 per epoch
    assert ddp["val_accuracy"] > 50 and hvd["val_accuracy"] > 50
    assert own["val_accuracy"] == pytest.approx(ddp["val_accuracy"], abs=0.6)  # the same loop on Horovod
    assert "hvdtrain / ddp = " in result.stdout and "own-loop / ddp = " in result.stdout


@pytest.mark.slow
def test_the_stop_agreement_benchmark_runs_every_contender_and_counts_the_agreements(tmp_path):
    """benchmarks/stop_agreement.py: every contender trains its steps; every-step sends one agreement
    per timed step, hvdtrain's interval far fewer (a step of milliseconds: one per ~0.5 s). Its
    timing (600 steps after 50, 3 rounds) is in
    benchmarks/results/stop-agreement_intel-xeon-2core_2026-11-27.md; here 40 steps after 5, once each."""
    result = subprocess.run([str(BIN / "python"), str(REPO / "benchmarks" / "stop_agreement.py"), "--rounds", "1",
                             "--steps", "40", "--warmup-steps", "5", "--bind", "rank",
                             "--contenders", "none,every-step,hvdtrain,ddp", "--out", str(tmp_path)], cwd=tmp_path,
                            env=job_env(tmp_path), capture_output=True, text=True, timeout=JOB_TIMEOUT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((tmp_path / "stop_agreement.json").read_text())
    runs = summary["runs"]
    # sparse: hvdtrain's path
    assert sorted(runs) == ["ddp", "every-step", "hvdtrain", "none"] and summary["bind"] == "rank"
    assert (summary["steps"], summary["warmup_steps"]) == (40, 5)
    assert all(contender[0]["steps"] == 40 and contender[0]["ms_per_step"] > 0 for contender in runs.values())
    assert runs["every-step"][0]["agreements"] == 40
    assert 1 <= runs["hvdtrain"][0]["agreements"] <= 20
    assert runs["none"][0]["agreements"] == runs["ddp"][0]["agreements"] == 0
    assert "paired ratio to none" in result.stdout
