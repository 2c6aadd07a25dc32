"""One job, one run folder (hvdtrain/train/run_folder.py, hvdtrain/launch/job.py): the folder a job
writes to under each scheduler and outside one, and a config file's folder that every job shares."""

from __future__ import annotations

import pytest

from hvdtrain.config import PACKAGED_CONFIGS, load_config
from hvdtrain.config.files import read_config_file
from hvdtrain.launch.job import Job, current
from hvdtrain.train import run_folder

SLURM = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "train.sbatch", "SLURM_RESTART_COUNT": "1",
         "SLURM_CLUSTER_NAME": "c1"}


@pytest.mark.parametrize("env, expected", [
    (SLURM, Job("Slurm", "4242", "train.sbatch", 1, "c1")),
    ({"PBS_JOBID": "77.server", "PBS_JOBNAME": "rn50"}, Job("PBS", "77.server", "rn50", 0, "")),
    ({"LSB_JOBID": "9", "LSB_JOBNAME": "a", "LSB_JOBINDEX": "3"}, Job("LSF", "9_3", "a", 0, "")),
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
