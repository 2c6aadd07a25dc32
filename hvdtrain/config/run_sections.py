"""The core sections about how a job runs: nested dataclasses, one comment per key.

Communication between the ranks, the run-time environment (devices, threads, the watchdog, stops),
the output folder, checkpoints, elastic membership and experiment tracking (dist, runtime, output,
checkpoint, elastic, tracking with its wandb and mlflow). What is trained is in
config/sections.py; both are gathered under the root ``Config`` in config/root.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class DistConfig:
    engine: Literal["horovod", "torch"] = "horovod"
    """What averages the gradients and runs the collectives: horovod (launch with horovodrun, mpirun, srun); torch =
    torch.distributed alone, Horovod not imported (launch with torchrun, or srun/mpirun with MASTER_ADDR and MASTER_PORT
    exported; on more than one rank HVDTRAIN_JOB_SECRET too; Gloo on CPU, NCCL on GPU); the settings only Horovod
    has stay horovod's, refused under torch in one line (docs/launching.md, "Two engines", lists them)."""
    compression: Literal["auto", "none", "fp16"] = "auto"
    """Gradient compression on the wire; auto = fp16 on GPU, none on CPU."""
    op: Literal["average", "adasum"] = "average"
    """Gradient reduction: average, or Horovod's Adasum (MPI controller only, a power-of-2 number of ranks; the rate is
    one rank's, not scaled by the ranks; no clipping or fp16 AMP; docs/launching.md, "Adasum")."""
    gradient_predivide_factor: float = 1.0
    """Horovod's DistributedOptimizer gradient_predivide_factor (the example's --gradient-predivide-factor): each
    gradient is divided by this before the sum and by ranks / this after it, which keeps fp16 sums in range; the
    gradients then go per tensor (Horovod's grouped allreduce has no such split: dist.bucket_mb is not used); 1 = plain
    average. Not with dist.op=adasum."""
    timeout_seconds: int = 45
    """Stop the job, naming the lost rank, when no training step completes for this long; also end a rank that makes no
    progress for this long after a stop signal (stuck where the stop is never agreed, exit 75); 0 = never."""
    straggler_threshold: float = 0.15
    """Name a rank whose busy time per step (data + compute + optimizer) exceeds the median rank's by more than this; 0
    = off."""
    stall_warning_seconds: int = 60
    """Horovod's stall inspector: warn when some ranks have not submitted a tensor the others wait on for this long; 0 =
    off."""
    stall_shutdown_seconds: int = 0
    """Horovod's stall inspector: shut the job down after a stall this long (above stall_warning_seconds); 0 = never."""
    sparse_as_dense: bool = False
    """Convert sparse gradients (model.sparse_embeddings) to dense before the allreduce; false = Horovod's sparse
    allgather."""
    bucket_mb: float = -1
    """Allreduce gradients in groups of about this many MB, in backward order, like DDP's buckets; 0 = each Horovod
    cycle fuses what is ready; -1 = auto: 25 on CPU, 0 on GPU, in elastic runs and with sparse embeddings."""


@dataclass
class RuntimeConfig:
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto = CUDA when available, pinned by Horovod local rank."""
    threads: int = 0
    """torch intra-op threads per rank; 0 = the job's CPUs per task (SLURM_CPUS_PER_TASK), else the rank's own cores
    or its affinity mask, else OMP_NUM_THREADS, else the host's cores divided by its ranks (the start-up line says
    which)."""
    cpu_affinity: Literal["auto", "rank", "none"] = "auto"
    """rank = each rank's threads (and loader workers) bound to its own block of the cores its host's ranks were started
    on (those no other job's processes are bound to, if enough remain); none = where the launcher put them; auto = rank
    on CPU where a host runs more than one rank of the job, unless the launcher bound the ranks itself or another job
    may share the cores (under Slurm, part of a node without binding; elsewhere, too few cores left by other jobs' bound
    processes: one line says so), none on GPU and in elastic runs."""
    host_malloc: Literal["auto", "tuned", "system"] = "auto"
    """glibc's malloc in each rank: tuned = the memory a step frees is kept for the next step (no mmap blocks, up to 1
    GiB kept at the heap's top), which spares the kernel's page faults on the CPU (resnet18 224 px, 1 thread: a step in
    0.72-1.04 of the time, median 0.89; peak memory 2-14% higher); system = glibc's defaults; auto = tuned on CPU,
    system on GPU. MALLOC_* variables, GLIBC_TUNABLES or an allocator in LD_PRELOAD win."""
    cudnn_benchmark: bool = True
    """Let cuDNN pick the fastest convolution algorithms (fixed input sizes)."""
    compile: bool = False
    """Compile the model with torch.compile (slower start; measure with hvdtrain bench)."""
    prefetch: bool = True
    """CUDA: copy (and normalize, or decode with data.decoder=nvimgcodec) the next batch on a side stream while the
    current step runs; false = when the step asks for it."""
    phase_timing: bool = True
    """Time each step's phases (data wait, forward+backward, allreduce wait, optimizer) per rank, and name
    stragglers."""
    stats_interval: float = 1.0
    """Seconds between samples of each rank's CPU, memory and (with NVML) GPU use, averaged per epoch; 0 = off."""
    timeline: str = ""
    """Write Horovod's timeline (Chrome trace JSON, with cycle marks) to this file; empty = off."""
    timeline_steps: str = ""
    """Global steps to record in the timeline, as START-END (e.g. 100-120); empty = the whole run."""
    audit: Literal["stop", "warn", "off"] = "stop"
    """Cross-rank audit: at every checkpoint and epoch end (and every runtime.audit_every steps), compare a fingerprint
    of each rank's parameters, buffers, optimizer state and GradScaler with rank 0's; stop = end the job naming the
    first differing tensor and the ranks; warn = say so and go on."""
    audit_every: int = 0
    """Also audit every this many optimizer steps; 0 = at checkpoints and epoch ends only."""
    preemption_notice: Literal["none", "aws", "azure", "gcp"] = "none"
    """Poll this cloud's spot/preemption notice; on a notice every rank checkpoints and exits 75, as on SIGTERM
    (docs/cloud.md)."""
    preemption_notice_url: str = ""
    """Base URL of the notice endpoint; empty = the cloud's (http://169.254.169.254, GCP:
    http://metadata.google.internal)."""
    preemption_poll_seconds: float = 5.0
    """Seconds between two polls of the notice endpoint (each request times out after 2 s)."""


@dataclass
class OutputConfig:
    dir: str = "auto"
    """Run directory: config.yaml, metrics.jsonl, tb/, checkpoints/; auto = runs/<job name>-<job id> under a scheduler
    (Slurm, PBS, LSF, SGE, Flux: a requeued job keeps its id, and so its folder), runs/<config name> elsewhere; under a
    scheduler a folder a config file names gets one folder per job inside it; a folder another job's run holds or uses
    stops the job in one line (train/run_folder.py)."""
    progress: bool = True
    """Progress per epoch on rank 0: a bar on a terminal, a line when output is piped (every 10% of the epoch, at most
    every 10 s, or as output.progress_every_steps says), with the epoch's running training loss and metric on rank 0's
    samples."""
    progress_every_steps: int = 0
    """A progress line every this many optimizer steps (main.py's --print-freq), and the bar's loss and metric updated
    as often; 0 = every 10% of the epoch, at most every 10 s."""
    tensorboard: bool = True
    """tensorboardX scalars under <output.dir>/tb (or output.tensorboard_dir)."""
    tensorboard_dir: str = ""
    """The folder of the TensorBoard event files, where the team's dashboards look (Horovod's example's --log-dir; one
    folder per run: TensorBoard names a run by its folder); made and checked as tb/ is (yours, nobody else can write it
    or swap it; output.share=group lets the group read it); empty = <output.dir>/tb."""
    tensorboard_tags: Literal["hvdtrain", "horovod_example"] = "hvdtrain"
    """The epoch curves' names: hvdtrain = every value of metrics.jsonl (train/loss, val/top1 in percent, ...) at the
    global step; horovod_example = Horovod's example's train/loss, train/accuracy, val/loss, val/accuracy (a fraction)
    at the 0-based epoch, with hvdtrain's values (every image counted once; docs/tracking.md)."""
    share: Literal["private", "group"] = "private"
    """Who may read the run folder: private = you alone (folders 0700, files 0600); group = your group too (0750, 0640;
    within your umask), and a group-writable run folder is accepted, as is a project folder above it that the group
    can write if it has the sticky bit (chmod +t). A folder another user owns, or that anyone can write, is never
    used."""


@dataclass
class CheckpointConfig:
    resume: str = "auto"
    """auto = continue from the newest readable checkpoint in <output.dir>/checkpoints, if it was trained with the same
    model, data, optimizer, schedule, seed and batch (else one line names the differences); force = continue it through
    such differences, recorded in metrics.jsonl; never; or a file."""
    every_steps: int = 0
    """Also checkpoint every this many optimizer steps, mid-epoch; 0 = at the end of each epoch only."""
    keep: int = 3
    """Numbered checkpoints (step-N.pt) kept besides last.pt and best.pt; 0 = last.pt and best.pt only."""
    best_metric: str = ""
    """Validation metric that picks best.pt, e.g. top1, ema_top1, loss (lower is better for *loss); empty = the task's
    (top1)."""


@dataclass
class ElasticConfig:
    enabled: bool = False
    """Run under Horovod Elastic (launch with horovodrun --min-np/--max-np --host-discovery-script)."""
    commit_every_steps: int = 10
    """Commit the in-memory state every this many steps; a failure rolls back to the last commit."""
    sample_log: bool = False
    """Log every rank's sample indices of every committed step to <output.dir>/samples.jsonl, to audit a run."""


@dataclass
class WandbConfig:
    enabled: bool = False
    """Send the run to Weights & Biases from rank 0 (pip install -e .[wandb])."""
    project: str = "hvdtrain"
    """W&B project."""
    entity: str = ""
    """W&B entity (team or user); empty = your default entity."""
    name: str = ""
    """Display name of the run; empty = the last folder of output.dir."""
    tags: str = ""
    """Comma-separated tags of the run."""
    mode: Literal["online", "offline"] = "online"
    """online = send to the W&B server; offline = write under <output.dir>/wandb, upload later with wandb sync."""


@dataclass
class MlflowConfig:
    enabled: bool = False
    """Send the run to an MLflow tracking server from rank 0 (pip install -e .[mlflow])."""
    tracking_uri: str = ""
    """e.g. http://host:5000; empty = $MLFLOW_TRACKING_URI, else MLflow's default."""
    experiment: str = "hvdtrain"
    """MLflow experiment (created when missing)."""
    run_name: str = ""
    """Run name; empty = the last folder of output.dir."""


@dataclass
class TrackingConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    every_steps: int = 10
    """Send the step-level train loss (and the task's metrics), learning rate and images/s every this many optimizer
    steps, to the trackers and to TensorBoard (train_step/..., keyed by the global step); 0 = epoch records only."""
    log_checkpoints: Literal["none", "best", "last"] = "none"
    """Upload checkpoints as artifacts: best = best.pt whenever it improves; last = last.pt at every epoch end."""
    flush_seconds: float = 60.0
    """At the end of the run or on a stop signal, wait at most this long for queued values to be sent and the tracker
    runs to end."""
