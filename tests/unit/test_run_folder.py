"""One job, one run folder (hvdtrain/train/run_folder.py, run_claim.py, hvdtrain/launch/job.py): the folder a job
writes to under each scheduler and outside one, a config file's folder that every job shares, the
owner record and lock, and the line that stops a second job. tests/multinode/test_slurm_requeue.py
submits two real jobs from one folder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hvdtrain.config import PACKAGED_CONFIGS
from hvdtrain.config.files import read_config_file
from hvdtrain.job_config import load_config
from hvdtrain.launch.job import Job, current, resume_hint
from hvdtrain.observe.metrics import MetricsWriter
from hvdtrain.train import run_claim, run_folder
from hvdtrain.train.run_claim import FolderRefused, claim_folder, read_owner

REPO = Path(__file__).resolve().parents[2]
SLURM = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "train.sbatch", "SLURM_RESTART_COUNT": "1",
         "SLURM_CLUSTER_NAME": "c1"}


@pytest.mark.parametrize("env, expected", [
    (SLURM, Job("Slurm", "4242", "train.sbatch", 1, "c1")),
    ({"PBS_JOBID": "77.server", "PBS_JOBNAME": "rn50"}, Job("PBS", "77.server", "rn50", 0, "")),
    ({"LSB_JOBID": "9", "LSB_JOBNAME": "a", "LSB_JOBINDEX": "3"}, Job("LSF", "9_3", "a", 0, "")),
    ({"SLURM_JOB_ID": "26", "SLURM_ARRAY_JOB_ID": "25", "SLURM_ARRAY_TASK_ID": "1", "SLURM_JOB_NAME": "a"},
     Job("Slurm", "25_1", "a", 0, "")),
    ({"JOB_ID": "5", "JOB_NAME": "b", "SGE_TASK_ID": "undefined"}, Job("SGE", "5", "b", 0, "")),
    ({}, Job()),
])
def test_the_job_comes_from_the_schedulers_variables(env, expected):
    assert current(env) == expected


def test_each_job_gets_its_own_folder_and_outside_a_scheduler_the_config_names_it():
    assert run_folder.default_output_dir(SLURM, "debug") == "runs/train.sbatch-4242"
    assert run_folder.default_output_dir({"PBS_JOBID": "77.server"}, "debug") == "runs/job-77.server"
    assert run_folder.default_output_dir({}, "debug") == "runs/debug"  # the same command again resumes
    assert run_folder.default_output_dir({}, None) == "runs/hvdtrain"
    # A folder a config file names is every job's that uses the file: the job's own goes inside it.
    assert run_folder.resolve_output_dir("/scratch/exp", SLURM, "cfg", from_file=True) == \
        "/scratch/exp/train.sbatch-4242"
    assert run_folder.resolve_output_dir("/scratch/exp", {}, "cfg", from_file=True) == "/scratch/exp"
    assert run_folder.resolve_output_dir("/scratch/exp", SLURM, "cfg") == "/scratch/exp"  # named by the user


def test_no_shipped_config_pins_a_folder():
    for path in sorted(PACKAGED_CONFIGS.glob("*.yaml")):
        assert "dir" not in (read_config_file(path).get("output") or {}), path.name


def test_the_config_resolves_the_folder_by_where_it_was_named(tmp_path, monkeypatch):
    for name, value in SLURM.items():
        monkeypatch.setenv(name, value)
    assert load_config("debug", []).output.dir == "runs/train.sbatch-4242"
    mine = tmp_path / "mine.yaml"
    mine.write_text("output:\n  dir: /scratch/exp\n")
    assert load_config(str(mine), []).output.dir == "/scratch/exp/train.sbatch-4242"
    assert load_config(str(mine), ["output.dir=/scratch/exp"]).output.dir == "/scratch/exp"
    monkeypatch.delenv("SLURM_JOB_ID")
    assert load_config("debug", []).output.dir == "runs/debug"
    assert load_config(str(mine), []).output.dir == "/scratch/exp"


def slurm_job(job_id: str, restart: int = 0) -> Job:
    return Job("Slurm", job_id, "train.sbatch", restart, "c1")


def fake_run(folder: Path) -> None:
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "checkpoints" / "last.pt").write_bytes(b"x")
    (folder / "metrics.jsonl").write_text("{}\n")


def test_a_folder_records_its_job_and_its_requeue_continues(tmp_path):
    held = claim_folder(tmp_path, "auto", slurm_job("10"))
    held.release()
    owner = read_owner(tmp_path)
    assert (owner["scheduler"], owner["job"], owner["cluster"], owner["restart"]) == ("Slurm", "10", "c1", 0)
    fake_run(tmp_path)
    (tmp_path / "attempts.jsonl").write_text('{"event": "start"}\n{"event": "end"}\n')
    again = claim_folder(tmp_path, "auto", slurm_job("10", restart=1))  # scontrol requeue: the same job id
    again.release()
    assert again.attempt == 1 and again.stamp() == {"job": "10", "attempt": 1}
    assert read_owner(tmp_path)["restart"] == 1


def test_another_jobs_run_is_continued_only_when_asked(tmp_path):
    claim_folder(tmp_path, "auto", slurm_job("10")).release()
    fake_run(tmp_path)
    for resume in ("auto", "never"):
        with pytest.raises(FolderRefused) as refused:
            claim_folder(tmp_path, resume, slurm_job("11"))
        line = str(refused.value)
        assert "\n" not in line
        assert line.startswith(f"the output folder '{tmp_path}' holds the run of Slurm job 10 (")
        assert "not of this job (Slurm job 11)" in line
        assert f"checkpoint.resume={tmp_path}/checkpoints/last.pt" in line and "runs/<job name>-<job id>" in line
    # Outside any scheduler the same: a Slurm job's run is not continued by accident.
    with pytest.raises(FolderRefused):
        claim_folder(tmp_path, "auto", Job())
    held = claim_folder(tmp_path, str(tmp_path / "checkpoints" / "last.pt"), slurm_job("11"))
    held.release()
    owner = read_owner(tmp_path)
    assert owner["job"] == "11" and owner["continues"]["job"] == "10"


def test_the_advice_after_a_stop_is_a_command_that_resumes(tmp_path):
    """Outside a scheduler the same command finds the same folder; a new scheduler job has a folder
    of its own, and continues this run only when told its folder and checkpoint (as above)."""
    assert resume_hint(tmp_path, Job()) == "Resume with the same command (checkpoint.resume=auto)."
    assert resume_hint(tmp_path / "my run", slurm_job("10")) == (
        f"A requeue of this job resumes it; a new job continues it with output.dir='{tmp_path}/my run' "
        f"checkpoint.resume='{tmp_path}/my run'/checkpoints/last.pt.")


def test_a_folder_without_a_run_or_outside_any_scheduler_is_taken(tmp_path):
    claim_folder(tmp_path, "auto", slurm_job("10")).release()
    claim_folder(tmp_path, "auto", slurm_job("11")).release()  # nothing written yet: nothing to mix with
    other = tmp_path / "outside"
    other.mkdir()
    claim_folder(other, "auto", Job()).release()
    fake_run(other)
    claim_folder(other, "auto", Job()).release()  # the same command again: it resumes


HOLDER = """
import sys
from pathlib import Path
from hvdtrain.launch.job import Job
from hvdtrain.train.run_claim import claim_folder
claim_folder(Path(sys.argv[1]), "auto", Job("Slurm", "10", "train.sbatch", 0, "c1"))
print("held", flush=True)
sys.stdin.read()
"""


def test_a_folder_in_use_stops_a_second_job_even_of_the_same_id(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    try:
        assert holder.stdout.readline() == "held\n"
        for job in (slurm_job("11"), slurm_job("10")):  # another job; a second srun of the same allocation
            with pytest.raises(FolderRefused) as refused:
                claim_folder(tmp_path, "force", job)
            assert str(refused.value).startswith(f"the output folder '{tmp_path}' is in use by Slurm job 10 (user ")
            assert "two runs would write one folder" in str(refused.value)
        # A requeued attempt of that job only starts once the old one ended: a lock still held is stale.
        held = claim_folder(tmp_path, "auto", slurm_job("10", restart=1))
        assert held.lock_fd is None and "going on without it" in held.notes[0]
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    claim_folder(tmp_path, "auto", slurm_job("10", restart=2)).release()  # the holder ended: its lock went with it


def test_without_file_locks_the_record_says_whether_its_job_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(run_claim, "take_lock", lambda path: (None, "unsupported"))
    claim_folder(tmp_path, "auto", slurm_job("10"))
    record = read_owner(tmp_path)
    (tmp_path / "job.json").write_text(json.dumps({**record, "pid": 999999999}))  # another process's
    with pytest.raises(FolderRefused, match="is in use by Slurm job 10"):
        claim_folder(tmp_path, "auto", slurm_job("11"), running=lambda record: record["job"] == "10")
    claim_folder(tmp_path, "auto", slurm_job("11"), running=lambda record: False)
    assert run_claim.still_running({"scheduler": "Slurm", "job": "7"}, scontrol=lambda job: "RUNNING")
    assert not run_claim.still_running({"scheduler": "Slurm", "job": "7"}, scontrol=lambda job: "COMPLETED")


def test_every_metrics_record_names_its_job_and_attempt(tmp_path):
    writer = MetricsWriter(tmp_path, tensorboard=False, stamp={"job": "4242", "attempt": 2})
    writer.write({"split": "train", "epoch": 0, "step": 3, "loss": 1.5})
    writer.close()
    record = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert record == {"split": "train", "epoch": 0, "step": 3, "loss": 1.5, "job": "4242", "attempt": 2}


def test_a_start_that_fails_before_writing_leaves_the_folder_as_it_was(tmp_path):
    folder = tmp_path / "runs" / "x"
    problem, held = run_folder.prepare_output_dir(folder, True, None, "auto", slurm_job("10"))
    assert problem is None and (folder / "job.json").exists()
    held.abandon()  # e.g. data.dir was wrong: no empty folder left behind
    assert not folder.exists()
    claim_folder(tmp_path, "auto", slurm_job("10")).release()
    before = (tmp_path / "job.json").read_bytes()
    problem, held = run_folder.prepare_output_dir(tmp_path, True, None, "auto", slurm_job("11"))
    held.abandon()
    assert (tmp_path / "job.json").read_bytes() == before  # the owner record given back
    fake_run(tmp_path)  # a run there whose checkpoint the start refused (another config): the same
    problem, held = run_folder.prepare_output_dir(tmp_path, True, None, "auto", slurm_job("10", restart=1))
    held.abandon()
    assert (tmp_path / "job.json").read_bytes() == before
