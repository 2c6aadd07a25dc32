"""The scheduler's job this process runs in: Slurm, and the other batch systems' job ids.

A job keeps its id when the scheduler requeues it (Slurm's ``scontrol requeue``, a node failure
with ``--requeue``; PBS ``qrerun``; LSF ``brequeue``), so the id names a run across its attempts,
and two jobs never share one. Outside a scheduler nothing names a job: ``Job.id`` is None.

Light on purpose (no torch, no Horovod): the config resolves the output folder from it before
either is imported.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass
from typing import Mapping

# scheduler, its job id variable, its job name variable, the variable of a task within an array
# job (where the id alone does not tell them apart), its cluster's name.
SCHEDULERS = (
    ("Slurm", "SLURM_JOB_ID", "SLURM_JOB_NAME", "", "SLURM_CLUSTER_NAME"),
    ("PBS", "PBS_JOBID", "PBS_JOBNAME", "", "PBS_SERVER"),
    ("LSF", "LSB_JOBID", "LSB_JOBNAME", "LSB_JOBINDEX", "LSF_CLUSTER_NAME"),
    ("Flux", "FLUX_JOB_ID", "FLUX_JOB_NAME", "", ""),
    ("SGE", "JOB_ID", "JOB_NAME", "SGE_TASK_ID", "SGE_CELL"),
)


@dataclass(frozen=True)
class Job:
    scheduler: str = ""         # "Slurm", "PBS", ...; "" outside a scheduler
    id: str | None = None       # the job id; a task of an array job: <array job id>_<task> (Slurm's 25_1)
    name: str = ""              # the job's name as the user gave it (sbatch -J, the script's name)
    restart: int | None = None  # times the scheduler requeued it (Slurm's SLURM_RESTART_COUNT)
    cluster: str = ""

    @property
    def key(self) -> str:
        """What tells two jobs apart, on a file system several clusters may share."""
        return f"{self.scheduler}:{self.cluster}:{self.id}" if self.id else ""

    def label(self) -> str:
        """'Slurm job 1234' (or 'no scheduler job' outside one), for the lines that name it."""
        return f"{self.scheduler} job {self.id}" if self.id else "a run outside any scheduler job"

    def folder_name(self) -> str:
        """``<job name>-<job id>``: one folder name of the user's free text and the id."""
        name = re.sub(r"[^A-Za-z0-9._-]+", "_", self.name.strip()).strip("._") or "job"
        job_id = re.sub(r"[^A-Za-z0-9._-]+", "_", self.id or "").strip("._") or "job"
        return f"{name}-{job_id}"

    def record(self) -> dict[str, object]:
        return {"scheduler": self.scheduler or None, "job": self.id, "cluster": self.cluster or None,
                "name": self.name or None, "restart": self.restart}


def current(env: Mapping[str, str] | None = None) -> Job:
    """The job of this process, from the first scheduler whose job id variable is set."""
    env = os.environ if env is None else env
    for scheduler, id_variable, name_variable, index_variable, cluster_variable in SCHEDULERS:
        job_id = env.get(id_variable, "").strip()
        if not job_id:
            continue
        index = env.get(index_variable, "").strip() if index_variable else ""
        if index and index not in ("0", "undefined"):
            job_id = f"{job_id}_{index}"
        array, task = env.get("SLURM_ARRAY_JOB_ID", "").strip(), env.get("SLURM_ARRAY_TASK_ID", "").strip()
        if scheduler == "Slurm" and array and task:  # each task has a job id of its own too; this is its name
            job_id = f"{array}_{task}"
        restart = env.get("SLURM_RESTART_COUNT", "") if scheduler == "Slurm" else ""
        return Job(scheduler, job_id, env.get(name_variable, "").strip(),
                   int(restart) if restart.isdigit() else 0,
                   env.get(cluster_variable, "").strip() if cluster_variable else "")
    return Job()


def resume_hint(run_dir: str | os.PathLike, job: Job | None = None) -> str:
    """How to resume a run stopped after a checkpoint. Outside a scheduler the same command finds
    the same folder. A scheduler's requeue keeps the job id and so the folder; a new job has a
    folder of its own (``runs/<job name>-<job id>``) and continues another job's run only when asked
    (train/run_folder.py): its output folder and last checkpoint, named."""
    job = current() if job is None else job
    if not job.id:
        return "Resume with the same command (checkpoint.resume=auto)."
    folder = shlex.quote(os.path.abspath(run_dir))
    return (f"A requeue of this job resumes it; a new job continues it with output.dir={folder} "
            f"checkpoint.resume={folder}/checkpoints/last.pt.")
