"""Configuration: nested dataclasses, YAML files and dotted command-line overrides.

Precedence is defaults < YAML file < ``key=value`` overrides. Every field has a type and a
docstring-like comment; unknown keys and badly typed values stop with one line that names the
key and what would have been valid.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, Literal

import yaml

from .keys import ConfigError, field_types, set_key, type_name

__all__ = ["Config", "ConfigError", "load_config", "apply_override", "from_dict", "to_dict", "dump_yaml", "validate"]

PACKAGED_CONFIGS = Path(__file__).parent / "configs"
# The tasks that ship with hvdtrain: config name -> "module:Class" (hvdtrain/tasks).
TASKS = {"image_classification": "hvdtrain.tasks.image_classification:ImageClassification",
         "recommendation": "hvdtrain.tasks.recommendation:Recommendation"}
# model.arch values of the recommendation task (hvdtrain/tasks/recommender_models.py).
RECOMMENDERS = ("mf", "ncf")


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
    # Recommendation (task=recommendation, model.arch=mf or ncf): docs/recommendation.md
    objective: Literal["explicit", "implicit"] = "explicit"
    """Recommendation: explicit = predict ratings (MSE; RMSE, MAE); implicit = rated or not (BCE with sampled negatives; HR@10, NDCG@10)."""
    embedding_dim: int = 32
    """Recommendation: factors per user and item (MF), the GMF branch's width (NCF)."""
    mlp_layers: str = "64,32,16"
    """Recommendation, NCF: MLP widths, the first = the two MLP embeddings concatenated."""
    embedding_l2: float = 0.0
    """Recommendation: L2 penalty on the embedding rows and biases a batch uses, added to the loss (works with sparse gradients, unlike optim.weight_decay)."""
    sparse_embeddings: bool = False
    """Recommendation: embeddings produce sparse gradients, sent through Horovod's sparse path (allgather) unless dist.sparse_as_dense."""
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
    max_image_pixels: int = 89478485
    """An image file of more pixels (width x height, read from its header) is a bad file, as data.on_bad_file says, for both decoders: a guard against decompression bombs; Pillow's limit by default; 0 = no limit."""
    index_cache: bool = True
    """Cache the file list of data.dir under $HVDTRAIN_CACHE (default ~/.cache/hvdtrain); false = scan at every start."""
    # Recommendation (MovieLens ratings.csv, u.data or ratings.dat in data.dir; empty = built-in data)
    split: Literal["leave_last_out", "random"] = "leave_last_out"
    """Recommendation: validation = each user's latest rating (leave_last_out, He et al. 2017) or a seeded random data.split_fraction of the ratings."""
    split_fraction: float = 0.1
    """Recommendation, data.split=random: the fraction of ratings held out for validation."""
    negatives: int = 4
    """Recommendation, implicit: sampled negatives per positive in training, drawn from (seed, epoch, index)."""
    eval_negatives: int = 100
    """Recommendation, implicit: items the user never rated ranked against each held-out one (HR@10, NDCG@10)."""
    on_bad_line: Literal["fail", "skip"] = "fail"
    """Recommendation: a malformed ratings line: fail = stop, naming the file and line; skip = count and skip it."""
    ratings_cache: bool = True
    """Recommendation: cache the parsed and split ratings next to the source (or under $HVDTRAIN_CACHE); rebuilt when the source changes."""
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
    steps_per_epoch: int = 0
    """Optimizer steps per epoch; 0 = the whole epoch (a cap for quick runs)."""
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
    """Applied to weights only: biases and normalization parameters get none."""
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
    no_decay: Literal["ndim", "norm", "names"] = "ndim"
    """Parameters without weight decay: ndim = every 1-d parameter (normalization and biases: MLPerf's reference, timm); norm = normalization layers only, biases decayed (Goyal et al., NVIDIA's MLPerf ResNet); names = those whose name contains one of optim.no_decay_names (FFCV and NVIDIA DeepLearningExamples: 'bn', which decays torchvision's downsample BatchNorm and the fc bias)."""
    no_decay_names: str = "bn"
    """optim.no_decay=names: comma-separated substrings of parameter names exempt from weight decay."""
    schedule: Literal["step", "cosine", "poly"] = "step"
    """step: x0.1 at 30/60/80 of 90 epochs (scaled to train.epochs); cosine: to optim.end_lr; poly: (1 - progress)^optim.poly_power to optim.end_lr (MLPerf)."""
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
    # --- optimizers for large batches (hvdtrain/optimizers.py, docs/recipes.md) ---
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
    """Stop the job, naming the lost rank, when no training step completes for this long; 0 = never."""
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
    """torch intra-op threads per rank; 0 = CPU cores divided by the ranks on this host."""
    cpu_affinity: Literal["auto", "rank", "none"] = "auto"
    """rank = each rank's threads (and loader workers) bound to its own block of the cores its host's ranks were started on; none = where the launcher put them; auto = rank on CPU unless the launcher bound the ranks itself, none on GPU and in elastic runs."""
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
    dir: str = "runs/hvdtrain"
    """Run directory: config.yaml, metrics.jsonl, tb/, checkpoints/."""
    progress: bool = True
    """Progress per epoch on rank 0: a bar on a terminal, a line every 10% when output is piped."""
    tensorboard: bool = True
    """tensorboardX scalars under <output.dir>/tb."""


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
    """Send the step-level train loss, learning rate and images/s every this many optimizer steps; 0 = epoch records only."""
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


@dataclass
class Config:
    task: str = "image_classification"
    """The workload (hvdtrain/tasks): image_classification, or your own task as module:Class or path/to/file.py:Class (docs/tasks.md)."""
    seed: int = 0
    """Seeds model initialization and the per-epoch shuffle (seed + epoch)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    amp: AmpConfig = field(default_factory=AmpConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    ema: EmaConfig = field(default_factory=EmaConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


def apply_mapping(cfg: Config, mapping: dict[str, Any], source: str = "config") -> None:
    """Apply a nested mapping (as read from YAML) onto ``cfg``."""
    if mapping is None:
        return
    if not isinstance(mapping, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections, got {type(mapping).__name__}")
    for key, value in mapping.items():
        set_key(cfg, str(key), value, from_text=False)


def apply_override(cfg: Config, text: str) -> None:
    """Apply one ``section.key=value`` override from the command line."""
    if "=" not in text:
        # A config file given without --config lands here: say how to give it.
        hint = f" (to read a config file, use --config {text})" if text.endswith((".yaml", ".yml")) else ""
        raise ConfigError(f"override '{text}' is not of the form section.key=value{hint}")
    key, value = text.split("=", 1)
    set_key(cfg, key.strip(), value.strip(), from_text=True)


def resolve_config_path(name_or_path: str) -> Path:
    """A path as given, or the name of a config shipped with hvdtrain (``debug``, ``demo``...)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    packaged = PACKAGED_CONFIGS / f"{name_or_path}.yaml"
    if packaged.is_file():
        return packaged
    shipped = ", ".join(sorted(p.stem for p in PACKAGED_CONFIGS.glob("*.yaml")))
    raise ConfigError(f"config file '{name_or_path}' not found (give a path, or one of: {shipped})")


# A config file is a few KB of keys (the largest shipped one is 2 KB). Larger files are refused before
# parsing: PyYAML took 32 s and 854 MB on an 80 MB one, and reads about 100 KB/s of dense YAML. So is
# nesting deeper than any config needs (sections are at most 3 deep): PyYAML's composer recurses
# once per level, and a deep enough file ended in a RecursionError traceback.
MAX_CONFIG_BYTES = 256 << 10
MAX_CONFIG_DEPTH = 20


class TooDeep(Exception):
    pass


class BoundedLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that stops composing past MAX_CONFIG_DEPTH levels of nesting."""

    depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self.depth += 1
        try:
            if self.depth > MAX_CONFIG_DEPTH + 1:  # + 1: the value at the bottom is a node too
                raise TooDeep
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


def read_config_file(path: Path) -> Any:
    """The YAML document of a config file, refused in one line when too large, too deep or invalid."""
    try:
        with open(path, "rb") as handle:
            text = handle.read(MAX_CONFIG_BYTES + 1)
    except OSError as error:
        raise ConfigError(f"cannot read config file '{path}': {error.strerror}") from None
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file '{path}' is larger than {MAX_CONFIG_BYTES >> 10} KB: a config holds a few KB "
                          "of keys (is it the right file?)")
    try:
        return yaml.load(text, Loader=BoundedLoader)  # a SafeLoader: no Python objects
    except TooDeep:
        raise ConfigError(f"config file '{path}' nests more than {MAX_CONFIG_DEPTH} levels deep: a config has "
                          "sections of keys (e.g. train: {epochs: 90}), at most 3 levels") from None
    except (yaml.YAMLError, ValueError) as error:  # ValueError: e.g. an integer of more than 4300 digits
        first = str(error).splitlines()[0].split("; use sys.")[0]
        raise ConfigError(f"config file '{path}' is not valid YAML: {first}") from None


def load_config(config_file: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults, then the YAML file, then the overrides; validated."""
    cfg = Config()
    if config_file:
        path = resolve_config_path(config_file)
        apply_mapping(cfg, read_config_file(path), source=str(path))
    for override in overrides:
        apply_override(cfg, override)
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Cross-field and range checks, each failing with one line."""
    if cfg.task not in TASKS and ":" not in cfg.task:
        close = difflib.get_close_matches(cfg.task, TASKS, n=1)
        raise ConfigError(f"config key 'task': unknown task '{cfg.task}' ("
                          + (f"did you mean '{close[0]}'?" if close else
                             f"one of {', '.join(TASKS)}, or module:Class or file.py:Class of your own") + ")")
    positive = {
        "train.epochs": cfg.train.epochs,
        "train.batch_size": cfg.train.batch_size,
        "train.backward_passes_per_step": cfg.train.backward_passes_per_step,
        "data.image_size": cfg.data.image_size,
        "data.prefetch_factor": cfg.data.prefetch_factor,
        "data.synthetic_samples": cfg.data.synthetic_samples,
        "elastic.commit_every_steps": cfg.elastic.commit_every_steps,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"config key '{key}' must be positive, got {value}")
    non_negative = {
        "train.steps_per_epoch": cfg.train.steps_per_epoch,
        "data.workers": cfg.data.workers,
        "data.val_resize": cfg.data.val_resize,
        "runtime.threads": cfg.runtime.threads,
        "checkpoint.every_steps": cfg.checkpoint.every_steps,
        "runtime.audit_every": cfg.runtime.audit_every,
        "amp.max_skipped_steps": cfg.amp.max_skipped_steps,
        "dist.timeout_seconds": cfg.dist.timeout_seconds,
        "checkpoint.keep": cfg.checkpoint.keep,
        "model.num_classes": cfg.model.num_classes,
        "optim.warmup_epochs": cfg.optim.warmup_epochs,
        "optim.weight_decay": cfg.optim.weight_decay,
        "optim.label_smoothing": cfg.optim.label_smoothing,
        "optim.clip_grad_norm": cfg.optim.clip_grad_norm,
        "dist.straggler_threshold": cfg.dist.straggler_threshold,
        "runtime.stats_interval": cfg.runtime.stats_interval,
        "dist.stall_warning_seconds": cfg.dist.stall_warning_seconds,
        "dist.stall_shutdown_seconds": cfg.dist.stall_shutdown_seconds,
        "data.shuffle_buffer": cfg.data.shuffle_buffer,
        "data.max_image_pixels": cfg.data.max_image_pixels,
    }
    for key, value in non_negative.items():
        if value < 0:
            raise ConfigError(f"config key '{key}' must be >= 0, got {value}")
    check_upper_bounds(cfg)
    if cfg.dist.bucket_mb < 0 and cfg.dist.bucket_mb != -1:
        raise ConfigError(f"config key 'dist.bucket_mb' must be >= 0 (MB), or -1 for auto, got {cfg.dist.bucket_mb}")
    # Gradient groups and what rules them out. Horovod's grouped DistributedOptimizer broadcasts the
    # parameter order when it is built, which a worker joining a running elastic job does alone.
    ungroupable = {"elastic.enabled": (cfg.elastic.enabled, "a joining worker would wait alone in the grouped "
                                                            "optimizer's broadcast"),
                   "model.sparse_embeddings": (cfg.model.sparse_embeddings, "Horovod's grouped allreduce takes "
                                                                            "no sparse gradients")}
    for key, (enabled, why) in ungroupable.items():
        if cfg.dist.bucket_mb > 0 and enabled:
            raise ConfigError(f"dist.bucket_mb={cfg.dist.bucket_mb:g} cannot be used with {key}=true ({why}): "
                              "leave dist.bucket_mb at -1 (auto) or 0")
    if cfg.checkpoint.every_steps and cfg.elastic.enabled:
        raise ConfigError(f"checkpoint.every_steps={cfg.checkpoint.every_steps} cannot be used with elastic.enabled=true "
                          "(elastic runs commit their state in memory every elastic.commit_every_steps steps and "
                          "checkpoint at each epoch end): set checkpoint.every_steps=0")
    if cfg.runtime.cpu_affinity == "rank" and cfg.elastic.enabled:
        raise ConfigError("runtime.cpu_affinity=rank cannot be used with elastic.enabled=true (the ranks on a host "
                          "change as workers come and go): leave it at auto or none")
    if not (cfg.optim.warmup_start == -1 or 0 <= cfg.optim.warmup_start <= 1):
        raise ConfigError(f"config key 'optim.warmup_start' is a fraction of the peak rate in [0, 1], or -1 "
                          f"(from optim.base_lr), got {cfg.optim.warmup_start}")
    if cfg.optim.base_lr <= 0:
        raise ConfigError(f"config key 'optim.base_lr' must be positive, got {cfg.optim.base_lr}")
    if cfg.optim.label_smoothing >= 1:
        raise ConfigError(f"config key 'optim.label_smoothing' must be below 1, got {cfg.optim.label_smoothing}")
    if not cfg.output.dir:
        raise ConfigError("config key 'output.dir' must not be empty")
    if cfg.model.dtype == "float64" and cfg.amp.enabled:
        raise ConfigError("model.dtype=float64 and amp.enabled=true exclude each other (set amp.enabled=false)")
    validate_recommendation(cfg)
    stall = cfg.dist
    if stall.stall_shutdown_seconds and stall.stall_shutdown_seconds <= stall.stall_warning_seconds:
        raise ConfigError(f"config key 'dist.stall_shutdown_seconds' ({stall.stall_shutdown_seconds}) must exceed "
                          f"dist.stall_warning_seconds ({stall.stall_warning_seconds}), or be 0 (never)")
    step_range(cfg.runtime.timeline_steps)
    validate_finetune_and_augment(cfg)
    validate_recipes(cfg)
    if cfg.runtime.timeline_steps and not cfg.runtime.timeline:
        raise ConfigError("config key 'runtime.timeline_steps' needs runtime.timeline=PATH (the file to write)")
    if cfg.runtime.preemption_poll_seconds <= 0:
        raise ConfigError(f"config key 'runtime.preemption_poll_seconds' must be positive, got {cfg.runtime.preemption_poll_seconds}")
    if cfg.runtime.preemption_notice_url and cfg.runtime.preemption_notice == "none":
        raise ConfigError("config key 'runtime.preemption_notice_url' is set but runtime.preemption_notice=none: "
                          "name the cloud (aws, azure or gcp)")
    if cfg.runtime.preemption_notice_url and not cfg.runtime.preemption_notice_url.startswith(("http://", "https://")):
        raise ConfigError(f"config key 'runtime.preemption_notice_url': expected an http:// or https:// URL, "
                          f"got '{cfg.runtime.preemption_notice_url}'")
    if cfg.tracking.every_steps < 0 or cfg.tracking.flush_seconds < 0:
        key = "every_steps" if cfg.tracking.every_steps < 0 else "flush_seconds"
        raise ConfigError(f"config key 'tracking.{key}' must be >= 0, got {getattr(cfg.tracking, key)}")
    if cfg.tracking.log_checkpoints != "none" and not (cfg.tracking.wandb.enabled or cfg.tracking.mlflow.enabled):
        raise ConfigError(f"config key 'tracking.log_checkpoints={cfg.tracking.log_checkpoints}' needs a tracker "
                          "(tracking.wandb.enabled=true or tracking.mlflow.enabled=true)")


# Upper bounds of the keys that start processes or threads or allocate in proportion to their value:
# beyond them a typo (workers=100000, image_size=100000, threads=1000000) hung for minutes or ended
# in an allocator traceback. Absolute numbers, not multiples of this machine's cores, so that a
# config valid on a login node is valid on the compute nodes; each far above real use.
UPPER_BOUNDS = {
    # A 2-socket node has about 256 hardware threads for all of its ranks.
    "data.workers": (256, "loader processes per rank"),
    # Training activations grow with the pixels: ResNet-50 needs about 0.1 GB per 224 px image, so
    # one 4096 px image some 30 GB; larger images fit no GPU.
    "data.image_size": (4096, "pixels a side"),
    "data.val_image_size": (4096, "pixels a side"),
    "data.min_res": (4096, "pixels a side"),
    "data.max_res": (4096, "pixels a side"),
    "data.val_resize": (8192, "pixels, the resize before the center crop"),
    "augment.pad": (4096, "pixels on each side"),
    # 2 to 4 batches in flight keep a loader busy; more only hold memory.
    "data.prefetch_factor": (64, "batches each worker loads ahead"),
    # Image tasks fit a few hundred per GPU; recommenders use up to 2^20 (MLPerf NCF's global batch).
    "train.batch_size": (1 << 20, "samples per rank"),
    # 45x ImageNet-21k; a 2048-wide head is then 8 GB of float32, mixup's soft targets more.
    "model.num_classes": (1_000_000, "classes"),
    "model.embedding_dim": (65536, "factors per row; recommenders use tens to hundreds"),
    "data.negatives": (1000, "per positive; He et al. 2017 use 4"),
    "data.eval_negatives": (100_000, "per held-out item; the usual protocol ranks 100"),
    "augment.magnitude_bins": (1024, "levels; RandAugment uses 31"),
    "augment.num_ops": (64, "operations per image; RandAugment uses 2"),
    # The largest machines have about 1000 hardware threads.
    "runtime.threads": (1024, "torch threads per rank"),
}


def check_upper_bounds(cfg: Config) -> None:
    for key, (bound, unit) in UPPER_BOUNDS.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value > bound:
            raise ConfigError(f"config key '{key}' must be at most {bound} ({unit}), got {value}")


def validate_recommendation(cfg: Config) -> None:
    model, data = cfg.model, cfg.data
    if cfg.task == "recommendation" and model.arch not in RECOMMENDERS:
        raise ConfigError(f"config key 'model.arch': task=recommendation takes {' or '.join(RECOMMENDERS)}, "
                          f"got '{model.arch}' (e.g. --config movielens or model.arch=mf)")
    if model.embedding_dim <= 0 or data.negatives <= 0 or data.eval_negatives <= 0:
        raise ConfigError("config keys 'model.embedding_dim', 'data.negatives' and 'data.eval_negatives' must be "
                          f"positive, got {model.embedding_dim}, {data.negatives}, {data.eval_negatives}")
    if not 0 < data.split_fraction < 1:
        raise ConfigError(f"config key 'data.split_fraction' must be between 0 and 1, got {data.split_fraction}")
    if model.embedding_l2 < 0:
        raise ConfigError(f"config key 'model.embedding_l2' must be >= 0, got {model.embedding_l2}")
    parts = model.mlp_layers.split(",")
    if not all(part.strip().isdigit() and int(part) > 0 for part in parts):
        raise ConfigError(f"config key 'model.mlp_layers': expected positive widths separated by commas, "
                          f"e.g. 64,32,16, got '{model.mlp_layers}'")
    if model.sparse_embeddings:
        if cfg.optim.name == "adam":
            raise ConfigError("model.sparse_embeddings=true needs optim.name=sgd or adagrad (torch's Adam "
                              "takes no sparse gradients), or set model.sparse_embeddings=false")
        if cfg.optim.weight_decay > 0:
            raise ConfigError("model.sparse_embeddings=true needs optim.weight_decay=0 (torch applies no weight "
                              "decay to sparse gradients): regularize with model.embedding_l2 instead")


def float_pair(key: str, text: str) -> tuple[float, float]:
    """A MIN,MAX config value (e.g. ``augment.scale``) -> (min, max), positive and ordered."""
    parts = text.replace(" ", "").split(",")
    try:
        low, high = (float(Fraction(part)) for part in parts)
    except (ValueError, ZeroDivisionError):
        raise ConfigError(f"config key '{key}': expected MIN,MAX (e.g. 0.08,1.0), got '{text}'") from None
    if not 0 < low <= high:
        raise ConfigError(f"config key '{key}': expected 0 < MIN <= MAX, got '{text}'")
    return low, high


def validate_finetune_and_augment(cfg: Config) -> None:
    """The keys of the augment section, data.val_fraction and optim.head_lr_mult."""
    aug = cfg.augment
    float_pair("augment.scale", aug.scale)
    float_pair("augment.ratio", aug.ratio)
    if aug.pad < 0:
        raise ConfigError(f"config key 'augment.pad' must be >= 0, got {aug.pad}")
    if not 0 <= aug.hflip <= 1:
        raise ConfigError(f"config key 'augment.hflip' is a probability (0 to 1), got {aug.hflip}")
    if not 0 <= cfg.data.val_fraction < 1:
        raise ConfigError(f"config key 'data.val_fraction' must be in [0, 1), got {cfg.data.val_fraction}")
    if cfg.optim.head_lr_mult <= 0:
        raise ConfigError(f"config key 'optim.head_lr_mult' must be positive, got {cfg.optim.head_lr_mult}")


def validate_recipes(cfg: Config) -> None:
    """The keys of docs/recipes.md: EMA, augmentation, progressive resizing, optimizers, target."""
    optim, augment, data, ema = cfg.optim, cfg.augment, cfg.data, cfg.ema
    if not 0 <= optim.momentum < 1:
        raise ConfigError(f"config key 'optim.momentum' must be in [0, 1) for optim.name={optim.name}, "
                          f"got {optim.momentum}")
    for key in ("beta1", "beta2"):
        if not 0 <= getattr(optim, key) < 1:
            raise ConfigError(f"config key 'optim.{key}' must be in [0, 1), got {getattr(optim, key)}")
    for key, value in (("optim.end_lr", optim.end_lr), ("optim.lars_eta", optim.lars_eta),
                       ("optim.eps", optim.eps), ("augment.mixup_alpha", augment.mixup_alpha),
                       ("augment.cutmix_alpha", augment.cutmix_alpha), ("train.target_top1", cfg.train.target_top1),
                       ("train.target", cfg.train.target),
                       ("data.min_res", data.min_res), ("data.max_res", data.max_res),
                       ("data.start_ramp", data.start_ramp), ("data.end_ramp", data.end_ramp),
                       ("data.val_image_size", data.val_image_size)):
        if value < 0:
            raise ConfigError(f"config key '{key}' must be >= 0, got {value}")
    if optim.poly_power <= 0:
        raise ConfigError(f"config key 'optim.poly_power' must be positive, got {optim.poly_power}")
    for key in ("random_erase", "mix_prob", "switch_prob"):
        if not 0 <= getattr(augment, key) <= 1:
            raise ConfigError(f"config key 'augment.{key}' is a probability in [0, 1], got {getattr(augment, key)}")
    if not 0 <= augment.magnitude < augment.magnitude_bins or augment.num_ops < 1:
        raise ConfigError(f"config keys 'augment.magnitude' ({augment.magnitude}) must be in [0, augment.magnitude_bins "
                          f"({augment.magnitude_bins})) and augment.num_ops ({augment.num_ops}) >= 1")
    if not 0 <= ema.decay < 1:
        raise ConfigError(f"config key 'ema.decay' must be in [0, 1) (0 = off; e.g. 0.9998), got {ema.decay}")
    if ema.every_steps < 1 or ema.warmup_gamma <= 0 or ema.warmup_power <= 0:
        raise ConfigError("config keys 'ema.every_steps', 'ema.warmup_gamma' and 'ema.warmup_power' must be positive")
    if bool(data.min_res) != bool(data.max_res):
        raise ConfigError("progressive resizing needs both data.min_res and data.max_res (or neither)")
    if data.min_res > data.max_res:
        raise ConfigError(f"config key 'data.min_res' ({data.min_res}) must not exceed data.max_res ({data.max_res})")
    if data.max_res and data.min_res < data.max_res and data.end_ramp <= data.start_ramp:
        raise ConfigError(f"config key 'data.end_ramp' ({data.end_ramp}) must exceed data.start_ramp "
                          f"({data.start_ramp}) when data.min_res < data.max_res")
    if cfg.train.target and cfg.train.target_top1:
        raise ConfigError("train.target and train.target_top1 are both set: train.target_top1 is the old name of "
                          "train.target, keep only train.target")
    for key, name in (("checkpoint.best_metric", cfg.checkpoint.best_metric),
                      ("train.target_metric", cfg.train.target_metric)):
        if name.startswith("ema_") and not ema.decay:
            raise ConfigError(f"{key}={name} needs the EMA (set ema.decay, e.g. 0.9998)")
    if cfg.train.target_metric and not target_value(cfg):
        raise ConfigError(f"train.target_metric={cfg.train.target_metric} is set but train.target is 0 (off): "
                          "set train.target too")
    if cfg.eval.ema and not ema.decay:
        raise ConfigError("eval.ema=true needs a checkpoint trained with the EMA (ema.decay > 0)")
    validate_published_recipes(cfg)


def validate_published_recipes(cfg: Config) -> None:
    """The keys that published recipes need (issue 37): warm-up start and stepping, weight-decay
    exemption, BCE, LARS/LAMB details, timm's RandAugment, validation crop and cadence."""
    optim, augment, data, evaluation = cfg.optim, cfg.augment, cfg.data, cfg.eval
    if not (optim.warmup_start_lr == -1 or optim.warmup_start_lr >= 0):
        raise ConfigError(f"config key 'optim.warmup_start_lr' is a rate >= 0, or -1 (as optim.warmup_start says), "
                          f"got {optim.warmup_start_lr}")
    if optim.warmup_start_lr >= 0 and optim.warmup_start != -1:
        raise ConfigError(f"optim.warmup_start={optim.warmup_start:g} and optim.warmup_start_lr="
                          f"{optim.warmup_start_lr:g} both say where the warm-up starts: set one of the two")
    names = [part.strip() for part in optim.no_decay_names.split(",")]
    if optim.no_decay == "names" and not all(names):
        raise ConfigError(f"config key 'optim.no_decay_names': expected name substrings separated by commas, "
                          f"e.g. bn, got '{optim.no_decay_names}'")
    if not 0 <= optim.bce_target_threshold < 1:
        raise ConfigError(f"config key 'optim.bce_target_threshold' must be in [0, 1) (0 = soft targets), "
                          f"got {optim.bce_target_threshold}")
    if optim.bce_target_threshold and optim.loss != "bce":
        raise ConfigError("optim.bce_target_threshold needs optim.loss=bce")
    if optim.lars_momentum_correction and optim.name != "lars":
        raise ConfigError(f"optim.lars_momentum_correction=true needs optim.name=lars, got {optim.name}")
    if optim.lamb_max_grad_norm < 0 or (optim.lamb_max_grad_norm and optim.name != "lamb"):
        raise ConfigError(f"config key 'optim.lamb_max_grad_norm' is >= 0 and needs optim.name=lamb "
                          f"(got {optim.lamb_max_grad_norm:g} with optim.name={optim.name})")
    if cfg.model.head_init_std < 0:
        raise ConfigError(f"config key 'model.head_init_std' must be >= 0, got {cfg.model.head_init_std}")
    if augment.policy == "timm_randaugment" and not 0 <= augment.magnitude <= 10:
        raise ConfigError(f"config key 'augment.magnitude' is on timm's 0-10 scale with augment.policy="
                          f"timm_randaugment, got {augment.magnitude}")
    if augment.magnitude_std < 0:
        raise ConfigError(f"config key 'augment.magnitude_std' must be >= 0, got {augment.magnitude_std}")
    if (augment.magnitude_std or augment.increasing_ops) and augment.policy != "timm_randaugment":
        raise ConfigError(f"augment.magnitude_std and augment.increasing_ops are timm's RandAugment options: "
                          f"they need augment.policy=timm_randaugment, got {augment.policy}")
    if not 0 <= data.val_crop_fraction <= 1:
        raise ConfigError(f"config key 'data.val_crop_fraction' must be in (0, 1] (0 = off), "
                          f"got {data.val_crop_fraction}")
    if data.val_crop_fraction and data.val_resize:
        raise ConfigError(f"data.val_crop_fraction={data.val_crop_fraction:g} and data.val_resize="
                          f"{data.val_resize} both set the validation resize: set one of the two")
    if data.val_interpolation != "bilinear" and data.decoder == "nvimgcodec":
        raise ConfigError(f"data.val_interpolation={data.val_interpolation} needs the CPU decoder: "
                          "set data.decoder=cpu (or auto)")
    if evaluation.every_epochs < 1 or not 0 <= evaluation.offset_epochs < evaluation.every_epochs:
        raise ConfigError(f"config keys 'eval.every_epochs' ({evaluation.every_epochs}) must be >= 1 and "
                          f"eval.offset_epochs ({evaluation.offset_epochs}) in [0, eval.every_epochs)")


def validates_after(cfg: Config, epoch: int) -> bool:
    """Whether the run validates after ``epoch`` (0-based): eval.every_epochs and eval.offset_epochs,
    and always after the last epoch."""
    every, offset = cfg.eval.every_epochs, cfg.eval.offset_epochs
    return epoch + 1 >= cfg.train.epochs or (epoch >= offset and (epoch - offset) % every == 0)


def target_value(cfg: Config) -> float:
    """``train.target``, or its old name ``train.target_top1``; 0 = no target."""
    return cfg.train.target or cfg.train.target_top1


def step_range(text: str) -> tuple[int, int] | None:
    """``runtime.timeline_steps``: "START-END" (global steps, END excluded) -> (start, end); "" -> None."""
    if not text:
        return None
    start, dash, end = text.partition("-")
    if not (dash and start.strip().isdigit() and end.strip().isdigit() and int(start) < int(end)):
        raise ConfigError(f"config key 'runtime.timeline_steps': expected START-END with START < END, "
                          f"e.g. 100-120, got '{text}'")
    return int(start), int(end)


def flatten(mapping: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"train": {"epochs": 3}}`` -> ``{"train.epochs": 3}``."""
    flat: dict[str, Any] = {}
    for key, value in mapping.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def from_dict(mapping: dict[str, Any]) -> Config:
    cfg = Config()
    apply_mapping(cfg, mapping)
    validate(cfg)
    return cfg


def dump_yaml(cfg: Config) -> str:
    """The config as YAML for people and files (--print-config, config.yaml): a password in a URL
    shows as *** (redact.py)."""
    from .redact import mask_values

    return yaml.safe_dump(mask_values(to_dict(cfg)), sort_keys=False)


def describe_keys() -> list[tuple[str, str, Any, str]]:
    """(key, type, default, doc) for every key: the README table is generated from this."""
    import ast
    import inspect

    rows = []

    def docs_of(cls: type) -> dict[str, str]:
        tree = ast.parse(inspect.getsource(cls))
        body = tree.body[0].body  # type: ignore[attr-defined]
        found = {}
        for node, after in zip(body, body[1:] + [None]):
            if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                found[node.target.id] = " ".join(str(after.value.value).split())  # type: ignore[union-attr]
        return found

    def walk(cls: type, prefix: str, instance: Any) -> None:
        docs = docs_of(cls)
        for name, tp in field_types(cls).items():
            value = getattr(instance, name)
            if dataclasses.is_dataclass(tp):
                walk(tp, f"{prefix}{name}.", value)
            else:
                rows.append((f"{prefix}{name}", type_name(tp), value, docs.get(name, "")))

    walk(Config, "", Config())
    return rows
