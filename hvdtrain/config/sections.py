"""The core sections about what is trained: nested dataclasses, one comment per key.

The model, the data and its augmentation, the training loop, the optimizer and its schedule, mixed
precision, the weights' moving average and evaluation (model, data, augment, train, optim, amp, ema,
eval). The sections about how a job runs (dist, runtime, output, checkpoint, elastic, tracking) are
in config/run_sections.py. All are gathered under the root ``Config`` in config/root.py, in the
order of the configuration table; a task's own keys live in its own section, declared by the task
(``Task.settings``, e.g. ``recommendation.embedding_dim``).
"""

from __future__ import annotations

from dataclasses import dataclass
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
    """Parameter and activation dtype; float64 is for numerical checks (e.g. N ranks vs one rank), several times
    slower."""
    weights: str = ""
    """Start from these weights (fresh runs): a torchvision weights name (IMAGENET1K_V1, DEFAULT), or a file (state
    dict, torchvision/timm checkpoint, hvdtrain checkpoint); empty = random init."""
    freeze: str = ""
    """Parameters that are not trained, as comma-separated name patterns (layer1, layer2.*, !fc); backbone = all but the
    classifier head. BatchNorm of frozen layers stays in eval mode."""
    # --- initialization and architecture details of published recipes (docs/recipes.md) ---
    zero_init_residual: bool = False
    """torchvision ResNets: start the last BatchNorm of every residual block with gamma = 0, so each block starts as the
    identity (Goyal et al. 2017; timm's zero_init_last); false = gamma 1."""
    conv_init: Literal["default", "fan_in", "fan_out"] = "default"
    """Convolution weights: default = the model's own (torchvision ResNet: Kaiming normal, fan_out); fan_in or fan_out =
    redrawn Kaiming normal (ReLU gain) with that fan (NVIDIA DeepLearningExamples and MLPerf: fan_in)."""
    head_init_std: float = 0.0
    """Classifier head: weights drawn from N(0, this std), bias 0 (Goyal et al. 2017 and NVIDIA's MLPerf ResNet: 0.01);
    0 = the model's own initialization."""
    blurpool: bool = False
    """FFCV's BlurPool: every convolution with stride > 1 and at least 16 input channels first blurs its input with a
    fixed [1 2 1] x [1 2 1] / 16 filter (libffcv/ffcv-imagenet train_imagenet.py)."""


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
    """Training samples per epoch with synthetic data (ImageNet-1k size by default); validation gets ImageNet's
    proportion (50000 at the default)."""
    workers: int = -1
    """DataLoader worker processes per rank (0 = load in the training process); -1 = auto: 4, but no more than the
    rank's share of the host's cores (its own cores, SLURM_CPUS_PER_TASK, or the cores / its ranks), said at
    start-up."""
    mp_context: Literal["forkserver", "spawn", "fork"] = "forkserver"
    """Start method for loader workers; forkserver is safe after MPI/NCCL initialization."""
    prefetch_factor: int = 2
    """Batches each worker loads ahead."""
    on_bad_file: Literal["skip", "fail"] = "skip"
    """An undecodable image: skip = warn, count (bad_files) and replace it; fail = stop, naming the file."""
    max_bad_fraction: float = 0.01
    """With data.on_bad_file=skip: the share of an epoch's training files, and of a validation pass's samples, that may
    fail (missing, unreadable, undecodable); past it, when 64 files in a row fail, or when a training tar shard cannot
    be read, every rank stops with a checkpoint of the last good step (validation: of the epoch's training, validated
    again on resume) and exit code 65 (data vanished: restore it and run the same command); 1 = never stop on a
    share."""
    max_image_pixels: int = 89478485
    """An image file of more pixels (width x height, read from its header) is a bad file, as data.on_bad_file says, for
    both decoders: a guard against decompression bombs; Pillow's limit by default; 0 = no limit."""
    index_cache: bool = True
    """Cache the file list of data.dir under $HVDTRAIN_CACHE (default ~/.cache/hvdtrain); false = scan at every
    start."""
    val_fraction: float = 0.0
    """0 = validate on val/; above 0, this fraction of each class of train/ is the validation set (seeded split, kept in
    <output.dir>/val_split.json); val/ is not needed."""
    # --- progressive resizing and test resolution (docs/recipes.md) ---
    min_res: int = 0
    """Progressive resizing: training resolution up to epoch data.start_ramp (FFCV's schedule); 0 = off (data.image_size
    throughout)."""
    max_res: int = 0
    """Progressive resizing: training resolution from epoch data.end_ramp on; rises linearly in between, rounded to a
    multiple of 32."""
    start_ramp: int = 0
    """Progressive resizing: last epoch (0-based) at data.min_res."""
    end_ramp: int = 0
    """Progressive resizing: first epoch (0-based) at data.max_res."""
    val_image_size: int = 0
    """Validation center-crop size; 0 = data.image_size (e.g. 224 for a 160-176 px training resolution: FixRes)."""
    format: Literal["auto", "folder", "shards"] = "auto"
    """folder = an ImageFolder; shards = tar shards from hvdtrain prepare (docs/data.md); auto = shards when data.dir
    holds a manifest.json or is a URL (s3://...)."""
    shuffle_buffer: int = 1000
    """Shards: records each loader worker shuffles in its seeded buffer (more = better mixing, more memory)."""
    val_crop_fraction: float = 0.0
    """Validation center crop as a fraction of the resized image: the resize is floor(crop / fraction) (timm's crop_pct;
    0.95 for timm's ResNet-strikes-back weights); 0 = data.val_resize, else round(crop / 0.875)."""
    val_interpolation: Literal["bilinear", "bicubic"] = "bilinear"
    """Validation resize filter (Pillow's, antialiased); the training crop's stays bilinear. bicubic is timm's for its
    ResNets (needs the CPU decoder)."""
    decoder: Literal["cpu", "nvimgcodec", "auto"] = "auto"
    """JPEG decoding: cpu = libjpeg-turbo in the loader workers; nvimgcodec = on the training device with nvImageCodec
    (the GPU's hardware JPEG decoder where it has one; its CPU backend without a GPU), the workers only read files and
    plan crops (make setup EXTRAS=gpudecode); auto = nvimgcodec on a GPU host that has it, else cpu."""


@dataclass
class AugmentConfig:
    crop: Literal["random_resized", "random_pad", "center"] = "random_resized"
    """Training crop: random_resized (ImageNet's RandomResizedCrop), random_pad (pad by augment.pad, random crop of
    image_size), center (the validation crop)."""
    scale: str = "0.08,1.0"
    """random_resized: the range of the crop's area, as a fraction of the image (MIN,MAX)."""
    ratio: str = "3/4,4/3"
    """random_resized: the range of the crop's aspect ratio (MIN,MAX; fractions allowed)."""
    pad: int = 4
    """random_pad: pixels of zero padding on each side of the image (resized to image_size) before the random crop."""
    hflip: float = 0.5
    """Probability of a horizontal flip; 0 = never (digits, text)."""
    policy: Literal["none", "trivialaugment", "randaugment", "autoaugment", "timm_randaugment"] = "none"
    """Augmentation policy on the uint8 training crops, seeded per sample: torchvision transforms.v2's, or
    timm_randaugment = timm's RandAugment (rand-mM-nN-mstdS-incI: each of augment.num_ops ops applied with probability
    0.5, magnitude on timm's 0-10 scale)."""
    magnitude: int = 9
    """RandAugment magnitude: torchvision's randaugment 0 .. augment.magnitude_bins - 1 (6 of 31 bins is 6/30 of the
    strongest); timm_randaugment 0 .. 10 (timm's m6 is 6/10: ShearX 0.18, Rotate 18 degrees)."""
    magnitude_std: float = 0.0
    """timm_randaugment: each op's magnitude drawn from N(augment.magnitude, this std), clipped to 0 .. 10 (timm's mstd,
    0.5 in rand-m6-mstd0.5); 0 = fixed."""
    increasing_ops: bool = False
    """timm_randaugment: timm's inc1 op set, in which Posterize, Solarize, Color, Contrast, Brightness and Sharpness
    grow stronger with the magnitude (false = timm's default set, where some weaken)."""
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
    """Samples per optimizer step, all ranks together; 0 = train.batch_size x ranks x train.backward_passes_per_step.
    Set one of the two: with this set, train.batch_size follows from the number of ranks (printed at start-up; refused
    in one line where it does not divide, or where an explicit train.batch_size disagrees)."""
    steps_per_epoch: int = 0
    """Optimizer steps per epoch; 0 = the whole epoch (a cap for quick runs)."""
    drop_last: bool = True
    """Leave out each epoch's last partial batch (every step a whole global batch); false = train on it too, as
    DistributedSampler and DataLoader's default do (pytorch/examples' imagenet/main.py): the epoch's order is padded by
    wrapping around to a multiple of the ranks (at most ranks - 1 samples seen twice), so that every rank's last batch
    has the same size and the average of the ranks' gradients is the mean over that smaller global batch. Elastic runs
    always keep it. Validation counts every sample once either way."""
    backward_passes_per_step: int = 1
    """Batches accumulated locally before each allreduce and optimizer step."""
    target: float = 0.0
    """Stop at the end of the first epoch whose validation train.target_metric reaches this (at or above it where the
    task says higher is better, at or below where lower is: RMSE, loss), and record the time to it; 0 = off."""
    target_metric: str = ""
    """The validation metric train.target applies to, e.g. top1, ema_top1, rmse; empty = the one that picks best.pt
    (checkpoint.best_metric, else the task's)."""
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
    """L2 weight decay; which parameters get none is optim.no_decay's (by default biases and normalization
    parameters)."""
    warmup_epochs: float = 5.0
    """Linear warm-up to the scaled learning rate over this many epochs, from the rate optim.warmup_start says."""
    warmup_start: float = -1.0
    """Where the warm-up starts, as a fraction of the scaled (peak) rate: 0 = from zero, 0.1 = a tenth of it; -1 = Goyal
    et al.: from the per-256 rate optim.base_lr, which is no warm-up at a global batch of 256 or less."""
    warmup_start_lr: float = -1.0
    """Where the warm-up starts, as an absolute rate (timm's warmup_lr, e.g. 1e-4); -1 = as optim.warmup_start says (set
    one of the two)."""
    warmup_prefix: bool = True
    """true: the cosine or poly decay runs from the end of the warm-up to the last epoch; false: it runs over the whole
    run from epoch 0 and the warm-up replaces its first epochs (timm's warmup_prefix=False)."""
    lr_step: Literal["step", "epoch", "epoch_warmup_end"] = "step"
    """How often the rate changes: step = every optimizer step; epoch = once per epoch, at the per-step schedule's value
    at the epoch's start (timm's schedulers); epoch_warmup_end = the same, except that each warm-up epoch takes the
    value the warm-up reaches at its end (NVIDIA DeepLearningExamples: peak x (epoch + 1) / warmup_epochs)."""
    no_decay: Literal["ndim", "norm", "names", "none"] = "ndim"
    """Parameters without weight decay: ndim = every 1-d parameter (normalization and biases: MLPerf's reference, timm);
    norm = normalization layers only, biases decayed (Goyal et al., NVIDIA's MLPerf ResNet); names = those whose name
    contains one of optim.no_decay_names (FFCV and NVIDIA DeepLearningExamples: 'bn', which decays torchvision's
    downsample BatchNorm and the fc bias); none = no exemption, weight decay on every parameter
    (torch.optim.SGD(model.parameters(), weight_decay=...): pytorch/examples' imagenet/main.py, torchvision's
    references)."""
    no_decay_names: str = "bn"
    """optim.no_decay=names: comma-separated substrings of parameter names exempt from weight decay."""
    schedule: Literal["step", "cosine", "poly", "constant"] = "step"
    """step: x optim.step_gamma (0.1) at 30/60/80 of 90 epochs, scaled to train.epochs, or at the fixed epochs
    optim.step_milestones or optim.step_every_epochs say; cosine: to optim.end_lr; poly: (1 - progress)^optim.poly_power
    to optim.end_lr (MLPerf); constant: the peak rate after the warm-up, to the end."""
    step_every_epochs: int = 0
    """optim.schedule=step: multiply the rate by optim.step_gamma every this many epochs, counted from epoch 0 and fixed
    whatever train.epochs (torch's StepLR(step_size=30) stepped once per epoch: pytorch/examples' imagenet/main.py); 0 =
    off."""
    step_milestones: str = ""
    """optim.schedule=step: the epochs at which the rate is multiplied by optim.step_gamma, comma-separated and fixed
    whatever train.epochs (torch's MultiStepLR, e.g. 30,60,80); empty = 30, 60 and 80 of 90 epochs scaled to
    train.epochs (unless optim.step_every_epochs is set)."""
    step_gamma: float = 0.1
    """optim.schedule=step: the factor at each step (StepLR's and MultiStepLR's gamma)."""
    lr: float = 0.0
    """The peak learning rate as it is, not scaled by the global batch (what a DDP script passes as lr=); 0 =
    optim.base_lr scaled linearly by the global batch. With it set, a warm-up starts from zero unless optim.warmup_start
    or optim.warmup_start_lr say otherwise."""
    lr_per_rank: float = 0.0
    """Horovod's example's --base-lr: the rate for one rank's batch (train.batch_size), scaled by the ranks and
    train.backward_passes_per_step as optim.base_lr is (not by the ranks under dist.op=adasum); a warm-up starts from
    it; 0 = optim.base_lr (per 256 images). The start-up line gives the rate in both units."""
    label_smoothing: float = 0.0
    """Label smoothing of the training loss (validation loss is plain cross-entropy)."""
    loss: Literal["cross_entropy", "bce"] = "cross_entropy"
    """Training loss: cross_entropy, or bce = binary cross-entropy with logits on (smoothed, mixed) one-hot targets,
    averaged over images and classes (timm's BinaryCrossEntropy; ResNet strikes back)."""
    bce_target_threshold: float = 0.0
    """optim.loss=bce: targets above this become 1 and the rest 0 (timm's bce_target_thresh); 0 = soft targets."""
    clip_grad_norm: float = 0.0
    """Clip the global gradient norm to this value after the allreduce; 0 = off."""
    head_lr_mult: float = 1.0
    """The classifier head's learning rate relative to the rest (fine-tuning: e.g. 10)."""
    # --- optimizers for large batches (hvdtrain/optim/lars_lamb.py, docs/recipes.md) ---
    name: Literal["sgd", "lars", "lamb", "adamw", "adagrad", "adam"] = "sgd"
    """sgd (momentum, nesterov); lars (MLPerf ResNet-50: layer-wise trust ratio, BN and biases excluded); lamb (timm);
    adamw; adagrad; adam. With sparse gradients (model.sparse_embeddings): sgd or adagrad, and optim.weight_decay=0."""
    end_lr: float = 0.0
    """Learning rate reached at the last step by the cosine and poly schedules (absolute, not scaled)."""
    poly_power: float = 2.0
    """Exponent of the poly schedule (MLPerf: 2; 1 = linear decay, FFCV's schedule)."""
    lars_eta: float = 0.001
    """LARS trust coefficient eta: local rate = eta * ||w|| / (||g|| + weight_decay * ||w||)."""
    lars_momentum_correction: bool = False
    """LARS: scale the momentum by lr_t / lr_(t-1) whenever the rate changes (Goyal et al.'s momentum correction, in
    NVIDIA's MLPerf LARS: the rate sits inside the momentum buffer)."""
    lamb_max_grad_norm: float = 0.0
    """LAMB: divide every gradient by max(1, global gradient norm / this) before the moments (timm's Lamb: 1.0); 0 =
    off."""
    beta1: float = 0.9
    """LAMB/AdamW first-moment decay."""
    beta2: float = 0.999
    """LAMB/AdamW second-moment decay."""
    eps: float = 1e-6
    """LAMB/AdamW denominator epsilon."""


@dataclass
class AmpConfig:
    enabled: bool = False
    """Automatic mixed precision (torch.autocast)."""
    dtype: Literal["float16", "bfloat16"] = "float16"
    """float16 uses a GradScaler; bfloat16 needs none. On a CPU, only worth it with bf16/fp16 instructions
    (AVX512-BF16, AMX): on AVX2, autocast convolutions take PyTorch's slow path (resnet18 ran 27x slower)."""
    max_skipped_steps: int = 50
    """float16: steps the GradScaler may skip in a row (inf/NaN gradients; each halves the scale) before the run stops
    as diverged; 0 = no limit."""


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
    """Validate after the epochs whose 0-based index e has e % eval.every_epochs == eval.offset_epochs, and after the
    last epoch (MLPerf ResNet: every 4, offset 2)."""
    offset_epochs: int = 0
    """The 0-based index of the first validated epoch, below eval.every_epochs (NVIDIA's MLPerf eval_offset 2 with
    period 4: after epochs 3, 7, 11, ... of the log's count)."""
