"""The core sections of the configuration: nested dataclasses, one comment per key.

These are the sections every task shares (model, data, augment, train, optim, dist, amp, runtime,
output, checkpoint, elastic, tracking, ema, eval), gathered under the root ``Config`` in
config/root.py. A task's own keys live in its own section, declared by the task
(``Task.settings``, e.g. ``recommendation.embedding_dim``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class ModelConfig:
    arch: str = "resnet50"
    """Any torchvision classification model name (torchvision.models.list_models)."""
    num_classes: int = 0
    """0 = the number of class folders in the dataset (1000 with synthetic data)."""
    sync_bn: bool = False
    """Replace BatchNorm with Horovod's SyncBatchNorm (statistics over the global batch)."""
    dtype: Literal["float32", "float64"] = "float32"
    """Parameter and activation dtype; float64 is for numerical checks (e.g. N ranks vs one rank), several times slower."""
    weights: str = ""
    """Start from these weights (fresh runs): a torchvision weights name (IMAGENET1K_V1, DEFAULT), or a file (state dict, torchvision/timm checkpoint, hvdtrain checkpoint); empty = random init."""
    freeze: str = ""
    """Parameters that are not trained, as comma-separated name patterns (layer1, layer2.*, !fc); backbone = all but the classifier head. BatchNorm of frozen layers stays in eval mode."""
    # --- initialization and architecture details of published recipes (docs/recipes.md) ---
    zero_init_residual: bool = False
    """torchvision ResNets: start the last BatchNorm of every residual block with gamma = 0, so each block starts as the identity (Goyal et al. 2017; timm's zero_init_last); false = gamma 1."""
    conv_init: Literal["default", "fan_in", "fan_out"] = "default"
    """Convolution weights: default = the model's own (torchvision ResNet: Kaiming normal, fan_out); fan_in or fan_out = redrawn Kaiming normal (ReLU gain) with that fan (NVIDIA DeepLearningExamples and MLPerf: fan_in)."""
    head_init_std: float = 0.0
    """Classifier head: weights drawn from N(0, this std), bias 0 (Goyal et al. 2017 and NVIDIA's MLPerf ResNet: 0.01); 0 = the model's own initialization."""
    blurpool: bool = False
    """FFCV's BlurPool: every convolution with stride > 1 and at least 16 input channels first blurs its input with a fixed [1 2 1] x [1 2 1] / 16 filter (libffcv/ffcv-imagenet train_imagenet.py)."""


@dataclass
class DataConfig:
    dir: str = ""
    """Folder with train/ and val/ ImageFolder trees; empty = the built-in demo dataset."""
    image_size: int = 224
    """Training crop and validation center-crop size."""
    val_resize: int = 0
    """Validation resize before the center crop; 0 = image_size / 0.875 (256 for 224)."""
    augment: bool = True
    """Training augmentation as set in the augment section; false = the deterministic validation transform."""
    synthetic: bool = False
    """Random tensors instead of files, for benchmarking the model and communication."""
    synthetic_samples: int = 1281167
    """Training samples per epoch with synthetic data (ImageNet-1k size by default); validation gets ImageNet's proportion (50000 at the default)."""
    workers: int = 4
    """DataLoader worker processes per rank (0 = load in the training process)."""
    mp_context: Literal["forkserver", "spawn", "fork"] = "forkserver"
    """Start method for loader workers; forkserver is safe after MPI/NCCL initialization."""
    prefetch_factor: int = 2
    """Batches each worker loads ahead."""
    on_bad_file: Literal["skip", "fail"] = "skip"
    """An undecodable image: skip = warn, count (bad_files) and replace it; fail = stop, naming the file."""
    max_bad_fraction: float = 0.01
    """With data.on_bad_file=skip: the share of an epoch's training files, and of a validation pass's samples, that may fail (missing, unreadable, undecodable); past it, when 64 files in a row fail, or when a training tar shard cannot be read, every rank stops with a checkpoint of the last good step (validation: of the epoch's training, validated again on resume) and exit code 65 (data vanished: restore it and run the same command); 1 = never stop on a share."""
    max_image_pixels: int = 89478485
    """An image file of more pixels (width x height, read from its header) is a bad file, as data.on_bad_file says, for both decoders: a guard against decompression bombs; Pillow's limit by default; 0 = no limit."""
    index_cache: bool = True
    """Cache the file list of data.dir under $HVDTRAIN_CACHE (default ~/.cache/hvdtrain); false = scan at every start."""
    val_fraction: float = 0.0
    """0 = validate on val/; above 0, this fraction of each class of train/ is the validation set (seeded split, kept in <output.dir>/val_split.json); val/ is not needed."""
    # --- progressive resizing and test resolution (docs/recipes.md) ---
    min_res: int = 0
    """Progressive resizing: training resolution up to epoch data.start_ramp (FFCV's schedule); 0 = off (data.image_size throughout)."""
    max_res: int = 0
    """Progressive resizing: training resolution from epoch data.end_ramp on; rises linearly in between, rounded to a multiple of 32."""
    start_ramp: int = 0
    """Progressive resizing: last epoch (0-based) at data.min_res."""
    end_ramp: int = 0
    """Progressive resizing: first epoch (0-based) at data.max_res."""
    val_image_size: int = 0
    """Validation center-crop size; 0 = data.image_size (e.g. 224 for a 160-176 px training resolution: FixRes)."""
    format: Literal["auto", "folder", "shards"] = "auto"
    """folder = an ImageFolder; shards = tar shards from hvdtrain prepare (docs/data.md); auto = shards when data.dir holds a manifest.json or is a URL (s3://...)."""
    shuffle_buffer: int = 1000
    """Shards: records each loader worker shuffles in its seeded buffer (more = better mixing, more memory)."""
    val_crop_fraction: float = 0.0
    """Validation center crop as a fraction of the resized image: the resize is floor(crop / fraction) (timm's crop_pct; 0.95 for timm's ResNet-strikes-back weights); 0 = data.val_resize, else round(crop / 0.875)."""
    val_interpolation: Literal["bilinear", "bicubic"] = "bilinear"
    """Validation resize filter (Pillow's, antialiased); the training crop's stays bilinear. bicubic is timm's for its ResNets (needs the CPU decoder)."""
    decoder: Literal["cpu", "nvimgcodec", "auto"] = "auto"
    """JPEG decoding: cpu = libjpeg-turbo in the loader workers; nvimgcodec = on the training device with nvImageCodec (the GPU's hardware JPEG decoder where it has one; its CPU backend without a GPU), the workers only read files and plan crops (make setup EXTRAS=gpudecode); auto = nvimgcodec on a GPU host that has it, else cpu."""


@dataclass
class AugmentConfig:
    crop: Literal["random_resized", "random_pad", "center"] = "random_resized"
    """Training crop: random_resized (ImageNet's RandomResizedCrop), random_pad (pad by augment.pad, random crop of image_size), center (the validation crop)."""
    scale: str = "0.08,1.0"
    """random_resized: the range of the crop's area, as a fraction of the image (MIN,MAX)."""
    ratio: str = "3/4,4/3"
    """random_resized: the range of the crop's aspect ratio (MIN,MAX; fractions allowed)."""
    pad: int = 4
    """random_pad: pixels of zero padding on each side of the image (resized to image_size) before the random crop."""
    hflip: float = 0.5
    """Probability of a horizontal flip; 0 = never (digits, text)."""
    policy: Literal["none", "trivialaugment", "randaugment", "autoaugment", "timm_randaugment"] = "none"
    """Augmentation policy on the uint8 training crops, seeded per sample: torchvision transforms.v2's, or timm_randaugment = timm's RandAugment (rand-mM-nN-mstdS-incI: each of augment.num_ops ops applied with probability 0.5, magnitude on timm's 0-10 scale)."""
    magnitude: int = 9
    """RandAugment magnitude: torchvision's randaugment 0 .. augment.magnitude_bins - 1 (6 of 31 bins is 6/30 of the strongest); timm_randaugment 0 .. 10 (timm's m6 is 6/10: ShearX 0.18, Rotate 18 degrees)."""
    magnitude_std: float = 0.0
    """timm_randaugment: each op's magnitude drawn from N(augment.magnitude, this std), clipped to 0 .. 10 (timm's mstd, 0.5 in rand-m6-mstd0.5); 0 = fixed."""
    increasing_ops: bool = False
    """timm_randaugment: timm's inc1 op set, in which Posterize, Solarize, Color, Contrast, Brightness and Sharpness grow stronger with the magnitude (false = timm's default set, where some weaken)."""
    num_ops: int = 2
    """RandAugment: operations per image."""
    magnitude_bins: int = 31
    """RandAugment / TrivialAugment: number of magnitude levels."""
    autoaugment_policy: Literal["imagenet", "cifar10", "svhn"] = "imagenet"
    """AutoAugment's learned policy."""
    random_erase: float = 0.0
    """RandomErasing probability per training image (erased to the mean pixel); 0 = off."""
    mixup_alpha: float = 0.0
    """Mixup: lambda ~ Beta(alpha, alpha), per batch; 0 = off."""
    cutmix_alpha: float = 0.0
    """CutMix: lambda ~ Beta(alpha, alpha), per batch; 0 = off."""
    mix_prob: float = 1.0
    """Probability that a batch is mixed at all (mixup or cutmix on)."""
    switch_prob: float = 0.5
    """With both mixup and cutmix on: probability of cutmix for a mixed batch."""


@dataclass
class TrainConfig:
    epochs: int = 90
    """Number of epochs."""
    batch_size: int = 32
    """Images per rank per backward pass."""
    global_batch_size: int = 0
    """Samples per optimizer step, all ranks together; 0 = train.batch_size x ranks x train.backward_passes_per_step. Set one of the two: with this set, train.batch_size follows from the number of ranks (printed at start-up; refused in one line where it does not divide, or where an explicit train.batch_size disagrees)."""
    steps_per_epoch: int = 0
    """Optimizer steps per epoch; 0 = the whole epoch (a cap for quick runs)."""
    drop_last: bool = True
    """Leave out each epoch's last partial batch (every step a whole global batch); false = train on it too, as DistributedSampler and DataLoader's default do (pytorch/examples' imagenet/main.py): the epoch's order is padded by wrapping around to a multiple of the ranks (at most ranks - 1 samples seen twice), so that every rank's last batch has the same size and the average of the ranks' gradients is the mean over that smaller global batch. Elastic runs always keep it. Validation counts every sample once either way."""
    backward_passes_per_step: int = 1
    """Batches accumulated locally before each allreduce and optimizer step."""
    target: float = 0.0
    """Stop at the end of the first epoch whose validation train.target_metric reaches this (at or above it where the task says higher is better, at or below where lower is: RMSE, loss), and record the time to it; 0 = off."""
    target_metric: str = ""
    """The validation metric train.target applies to, e.g. top1, ema_top1, rmse; empty = the one that picks best.pt (checkpoint.best_metric, else the task's)."""
    target_top1: float = 0.0
    """The old name of train.target (same meaning, kept for old configs); set one of the two."""


@dataclass
class OptimConfig:
    base_lr: float = 0.1
    """Learning rate per 256 images; scaled linearly by the global batch (Goyal et al. 2017)."""
    momentum: float = 0.9
    """SGD momentum."""
    nesterov: bool = True
    """Nesterov momentum."""
    weight_decay: float = 1e-4
    """L2 weight decay; which parameters get none is optim.no_decay's (by default biases and normalization parameters)."""
    warmup_epochs: float = 5.0
    """Linear warm-up to the scaled learning rate over this many epochs, from the rate optim.warmup_start says."""
    warmup_start: float = -1.0
    """Where the warm-up starts, as a fraction of the scaled (peak) rate: 0 = from zero, 0.1 = a tenth of it; -1 = Goyal et al.: from the per-256 rate optim.base_lr, which is no warm-up at a global batch of 256 or less."""
    warmup_start_lr: float = -1.0
    """Where the warm-up starts, as an absolute rate (timm's warmup_lr, e.g. 1e-4); -1 = as optim.warmup_start says (set one of the two)."""
    warmup_prefix: bool = True
    """true: the cosine or poly decay runs from the end of the warm-up to the last epoch; false: it runs over the whole run from epoch 0 and the warm-up replaces its first epochs (timm's warmup_prefix=False)."""
    lr_step: Literal["step", "epoch", "epoch_warmup_end"] = "step"
    """How often the rate changes: step = every optimizer step; epoch = once per epoch, at the per-step schedule's value at the epoch's start (timm's schedulers); epoch_warmup_end = the same, except that each warm-up epoch takes the value the warm-up reaches at its end (NVIDIA DeepLearningExamples: peak x (epoch + 1) / warmup_epochs)."""
    no_decay: Literal["ndim", "norm", "names", "none"] = "ndim"
    """Parameters without weight decay: ndim = every 1-d parameter (normalization and biases: MLPerf's reference, timm); norm = normalization layers only, biases decayed (Goyal et al., NVIDIA's MLPerf ResNet); names = those whose name contains one of optim.no_decay_names (FFCV and NVIDIA DeepLearningExamples: 'bn', which decays torchvision's downsample BatchNorm and the fc bias); none = no exemption, weight decay on every parameter (torch.optim.SGD(model.parameters(), weight_decay=...): pytorch/examples' imagenet/main.py, torchvision's references)."""
    no_decay_names: str = "bn"
    """optim.no_decay=names: comma-separated substrings of parameter names exempt from weight decay."""
    schedule: Literal["step", "cosine", "poly", "constant"] = "step"
    """step: x optim.step_gamma (0.1) at 30/60/80 of 90 epochs, scaled to train.epochs, or at the fixed epochs optim.step_milestones or optim.step_every_epochs say; cosine: to optim.end_lr; poly: (1 - progress)^optim.poly_power to optim.end_lr (MLPerf); constant: the peak rate after the warm-up, to the end."""
    step_every_epochs: int = 0
    """optim.schedule=step: multiply the rate by optim.step_gamma every this many epochs, counted from epoch 0 and fixed whatever train.epochs (torch's StepLR(step_size=30) stepped once per epoch: pytorch/examples' imagenet/main.py); 0 = off."""
    step_milestones: str = ""
    """optim.schedule=step: the epochs at which the rate is multiplied by optim.step_gamma, comma-separated and fixed whatever train.epochs (torch's MultiStepLR, e.g. 30,60,80); empty = 30, 60 and 80 of 90 epochs scaled to train.epochs (unless optim.step_every_epochs is set)."""
    step_gamma: float = 0.1
    """optim.schedule=step: the factor at each step (StepLR's and MultiStepLR's gamma)."""
    lr: float = 0.0
    """The peak learning rate as it is, not scaled by the global batch (what a DDP script passes as lr=); 0 = optim.base_lr scaled linearly by the global batch. With it set, a warm-up starts from zero unless optim.warmup_start or optim.warmup_start_lr say otherwise."""
    label_smoothing: float = 0.0
    """Label smoothing of the training loss (validation loss is plain cross-entropy)."""
    loss: Literal["cross_entropy", "bce"] = "cross_entropy"
    """Training loss: cross_entropy, or bce = binary cross-entropy with logits on (smoothed, mixed) one-hot targets, averaged over images and classes (timm's BinaryCrossEntropy; ResNet strikes back)."""
    bce_target_threshold: float = 0.0
    """optim.loss=bce: targets above this become 1 and the rest 0 (timm's bce_target_thresh); 0 = soft targets."""
    clip_grad_norm: float = 0.0
    """Clip the global gradient norm to this value after the allreduce; 0 = off."""
    head_lr_mult: float = 1.0
    """The classifier head's learning rate relative to the rest (fine-tuning: e.g. 10)."""
    # --- optimizers for large batches (hvdtrain/optim/lars_lamb.py, docs/recipes.md) ---
    name: Literal["sgd", "lars", "lamb", "adamw", "adagrad", "adam"] = "sgd"
    """sgd (momentum, nesterov); lars (MLPerf ResNet-50: layer-wise trust ratio, BN and biases excluded); lamb (timm); adamw; adagrad; adam. With sparse gradients (model.sparse_embeddings): sgd or adagrad, and optim.weight_decay=0."""
    end_lr: float = 0.0
    """Learning rate reached at the last step by the cosine and poly schedules (absolute, not scaled)."""
    poly_power: float = 2.0
    """Exponent of the poly schedule (MLPerf: 2; 1 = linear decay, FFCV's schedule)."""
    lars_eta: float = 0.001
    """LARS trust coefficient eta: local rate = eta * ||w|| / (||g|| + weight_decay * ||w||)."""
    lars_momentum_correction: bool = False
    """LARS: scale the momentum by lr_t / lr_(t-1) whenever the rate changes (Goyal et al.'s momentum correction, in NVIDIA's MLPerf LARS: the rate sits inside the momentum buffer)."""
    lamb_max_grad_norm: float = 0.0
    """LAMB: divide every gradient by max(1, global gradient norm / this) before the moments (timm's Lamb: 1.0); 0 = off."""
    beta1: float = 0.9
    """LAMB/AdamW first-moment decay."""
    beta2: float = 0.999
    """LAMB/AdamW second-moment decay."""
    eps: float = 1e-6
    """LAMB/AdamW denominator epsilon."""


@dataclass
class DistConfig:
    compression: Literal["auto", "none", "fp16"] = "auto"
    """Gradient compression on the wire; auto = fp16 on GPU, none on CPU."""
    op: Literal["average", "adasum"] = "average"
    """Gradient reduction."""
    timeout_seconds: int = 45
    """Stop the job, naming the lost rank, when no training step completes for this long; also end a rank that makes no progress for this long after a stop signal (stuck where the stop is never agreed, exit 75); 0 = never."""
    straggler_threshold: float = 0.15
    """Name a rank whose busy time per step (data + compute + optimizer) exceeds the median rank's by more than this; 0 = off."""
    stall_warning_seconds: int = 60
    """Horovod's stall inspector: warn when some ranks have not submitted a tensor the others wait on for this long; 0 = off."""
    stall_shutdown_seconds: int = 0
    """Horovod's stall inspector: shut the job down after a stall this long (above stall_warning_seconds); 0 = never."""
    sparse_as_dense: bool = False
    """Convert sparse gradients (model.sparse_embeddings) to dense before the allreduce; false = Horovod's sparse allgather."""
    bucket_mb: float = -1
    """Allreduce gradients in groups of about this many MB, in backward order, like DDP's buckets; 0 = each Horovod cycle fuses what is ready; -1 = auto: 25 on CPU, 0 on GPU, in elastic runs and with sparse embeddings."""


@dataclass
class AmpConfig:
    enabled: bool = False
    """Automatic mixed precision (torch.autocast)."""
    dtype: Literal["float16", "bfloat16"] = "float16"
    """float16 uses a GradScaler; bfloat16 needs none. On a CPU, only worth it with bf16/fp16 instructions
    (AVX512-BF16, AMX): on AVX2, autocast convolutions take PyTorch's slow path (resnet18 ran 27x slower)."""
    max_skipped_steps: int = 50
    """float16: steps the GradScaler may skip in a row (inf/NaN gradients; each halves the scale) before the run stops as diverged; 0 = no limit."""


@dataclass
class RuntimeConfig:
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto = CUDA when available, pinned by Horovod local rank."""
    threads: int = 0
    """torch intra-op threads per rank; 0 = the job's CPUs per task (SLURM_CPUS_PER_TASK), else the rank's own cores or its affinity mask, else OMP_NUM_THREADS, else the host's cores divided by its ranks (the start-up line says which)."""
    cpu_affinity: Literal["auto", "rank", "none"] = "auto"
    """rank = each rank's threads (and loader workers) bound to its own block of the cores its host's ranks were started on (those no other job's processes are bound to, if enough remain); none = where the launcher put them; auto = rank on CPU where a host runs more than one rank of the job, unless the launcher bound the ranks itself or another job may share the cores (under Slurm, part of a node without binding; elsewhere, too few cores left by other jobs' bound processes: one line says so), none on GPU and in elastic runs."""
    host_malloc: Literal["auto", "tuned", "system"] = "auto"
    """glibc's malloc in each rank: tuned = the memory a step frees is kept for the next step (no mmap blocks, up to 1 GiB kept at the heap's top), which spares the kernel's page faults on the CPU (resnet18 224 px, 1 thread: a step in 0.72-1.04 of the time, median 0.89; peak memory 2-14% higher); system = glibc's defaults; auto = tuned on CPU, system on GPU. MALLOC_* variables, GLIBC_TUNABLES or an allocator in LD_PRELOAD win."""
    cudnn_benchmark: bool = True
    """Let cuDNN pick the fastest convolution algorithms (fixed input sizes)."""
    compile: bool = False
    """Compile the model with torch.compile (slower start; measure with hvdtrain bench)."""
    prefetch: bool = True
    """CUDA: copy (and normalize, or decode with data.decoder=nvimgcodec) the next batch on a side stream while the current step runs; false = when the step asks for it."""
    phase_timing: bool = True
    """Time each step's phases (data wait, forward+backward, allreduce wait, optimizer) per rank, and name stragglers."""
    stats_interval: float = 1.0
    """Seconds between samples of each rank's CPU, memory and (with NVML) GPU use, averaged per epoch; 0 = off."""
    timeline: str = ""
    """Write Horovod's timeline (Chrome trace JSON, with cycle marks) to this file; empty = off."""
    timeline_steps: str = ""
    """Global steps to record in the timeline, as START-END (e.g. 100-120); empty = the whole run."""
    audit: Literal["stop", "warn", "off"] = "stop"
    """Cross-rank audit: at every checkpoint and epoch end (and every runtime.audit_every steps), compare a fingerprint of each rank's parameters, buffers, optimizer state and GradScaler with rank 0's; stop = end the job naming the first differing tensor and the ranks; warn = say so and go on."""
    audit_every: int = 0
    """Also audit every this many optimizer steps; 0 = at checkpoints and epoch ends only."""
    preemption_notice: Literal["none", "aws", "azure", "gcp"] = "none"
    """Poll this cloud's spot/preemption notice; on a notice every rank checkpoints and exits 75, as on SIGTERM (docs/cloud.md)."""
    preemption_notice_url: str = ""
    """Base URL of the notice endpoint; empty = the cloud's (http://169.254.169.254, GCP: http://metadata.google.internal)."""
    preemption_poll_seconds: float = 5.0
    """Seconds between two polls of the notice endpoint (each request times out after 2 s)."""


@dataclass
class OutputConfig:
    dir: str = "auto"
    """Run directory: config.yaml, metrics.jsonl, tb/, checkpoints/; auto = runs/<job name>-<job id> under a scheduler (Slurm, PBS, LSF, SGE, Flux: a requeued job keeps its id, and so its folder), runs/<config name> elsewhere; under a scheduler a folder a config file names gets one folder per job inside it; a folder another job's run holds or uses stops the job in one line (train/run_folder.py)."""
    progress: bool = True
    """Progress per epoch on rank 0: a bar on a terminal, a line when output is piped (every 10% of the epoch, at most every 10 s, or as output.progress_every_steps says), with the epoch's running training loss and metric on rank 0's samples."""
    progress_every_steps: int = 0
    """A progress line every this many optimizer steps (main.py's --print-freq), and the bar's loss and metric updated as often; 0 = every 10% of the epoch, at most every 10 s."""
    tensorboard: bool = True
    """tensorboardX scalars under <output.dir>/tb."""
    share: Literal["private", "group"] = "private"
    """Who may read the run folder: private = you alone (folders 0700, files 0600); group = your group too (0750, 0640; within your umask), and a group-writable run folder or project folder above it is accepted. A folder another user owns, or that anyone can write, is never used."""


@dataclass
class CheckpointConfig:
    resume: str = "auto"
    """auto = continue from the newest readable checkpoint in <output.dir>/checkpoints, if it was trained with the same model, data, optimizer, schedule, seed and batch (else one line names the differences); force = continue it through such differences, recorded in metrics.jsonl; never; or a file."""
    every_steps: int = 0
    """Also checkpoint every this many optimizer steps, mid-epoch; 0 = at the end of each epoch only."""
    keep: int = 3
    """Numbered checkpoints (step-N.pt) kept besides last.pt and best.pt; 0 = last.pt and best.pt only."""
    best_metric: str = ""
    """Validation metric that picks best.pt, e.g. top1, ema_top1, loss (lower is better for *loss); empty = the task's (top1)."""


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
    """Send the step-level train loss (and the task's metrics), learning rate and images/s every this many optimizer steps, to the trackers and to TensorBoard (train_step/..., keyed by the global step); 0 = epoch records only."""
    log_checkpoints: Literal["none", "best", "last"] = "none"
    """Upload checkpoints as artifacts: best = best.pt whenever it improves; last = last.pt at every epoch end."""
    flush_seconds: float = 60.0
    """At the end of the run or on a stop signal, wait at most this long for queued values to be sent and the tracker runs to end."""


@dataclass
class EmaConfig:
    decay: float = 0.0
    """Model EMA: ema = decay * ema + (1 - decay) * weights after the optimizer step; 0 = off (e.g. 0.9998)."""
    every_steps: int = 1
    """Update the EMA every this many optimizer steps."""
    warmup: bool = True
    """Warm the decay up as timm's ModelEmaV3: min(decay, 1 - (1 + step / ema.warmup_gamma)^-ema.warmup_power)."""
    warmup_gamma: float = 1.0
    """timm's warm-up gamma."""
    warmup_power: float = 0.6667
    """timm's warm-up power (2/3; 3/4 for short runs)."""


@dataclass
class EvalConfig:
    flip: bool = False
    """Test-time augmentation: average the logits of each validation image and its mirror image."""
    ema: bool = False
    """hvdtrain evaluate: score the checkpoint's EMA weights instead of the raw ones."""
    every_epochs: int = 1
    """Validate after the epochs whose 0-based index e has e % eval.every_epochs == eval.offset_epochs, and after the last epoch (MLPerf ResNet: every 4, offset 2)."""
    offset_epochs: int = 0
    """The 0-based index of the first validated epoch, below eval.every_epochs (NVIDIA's MLPerf eval_offset 2 with period 4: after epochs 3, 7, 11, ... of the log's count)."""
