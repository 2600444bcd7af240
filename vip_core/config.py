"""Configuration: frozen pydantic models, validated on construction, and named presets.

One :class:`VipConfig` describes a whole pipeline run. It is the Prefect flow parameter (the UI renders
it as a form) and is flattened into MLflow params by :func:`flatten`. Fields hold public hyperparameters
only: the private dataset's size is measured at run time and enters through
:func:`vip_core.privacy.plan.plan_privacy`, which checks the batch against it and calibrates σ against the
data set's ledger.

A user reaches every field without editing Python: :func:`resolve_config` layers a config file (YAML, TOML or
JSON, :func:`read_config_file`) and ``FIELD=VALUE`` settings (:func:`parse_setting`) on a preset, for the ``vip``
commands, the make targets and the deployments alike; :func:`config_yaml` writes a whole config as such a file.
"""

from __future__ import annotations

import difflib
import json
import tomllib
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, Mapping, Sequence, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

Accountant = Literal["prv", "pld", "rdp"]
# Where a stage's pieces of work run: this machine's processes, or the Ray cluster (tasks/runtime/runner.py).
Distributor = Literal["multiprocessing", "ray"]
DISTRIBUTORS: tuple[str, ...] = get_args(Distributor)
# The evaluation tasks, defined here once: the config, the jobs, the flows and ``vip eval`` read them.
EvalTask = Literal["linprobe", "finetune", "fewshot", "coco", "ade20k"]
EVAL_TASKS: tuple[str, ...] = get_args(EvalTask)
# The layouts ``vip export`` writes (vip_core/models/export.py).
ExportFormat = Literal["timm", "mae", "safetensors"]
EXPORT_FORMATS: tuple[str, ...] = get_args(ExportFormat)
# The weights of a checkpoint that evaluation and ``vip export`` load: the final ones or their moving average.
EncoderWeights = Literal["final", "ema"]
ENCODER_WEIGHTS: tuple[str, ...] = get_args(EncoderWeights)
# The offline data set of each task below an evaluation root (an ImageFolder, a COCO and an ADE20K set): the tiny
# preset's suite, and the data set a pair's name leaves out (``EvalPair.name``).
EVAL_DATA_FOLDERS: dict[str, str] = {
    "linprobe": "classification", "finetune": "classification", "fewshot": "classification",
    "coco": "coco", "ade20k": "ade20k",
}
# The jobs that train (a head or the encoder): they run as Ray Train jobs when ``evaluation.num_workers`` > 0.
TRAINING_TASKS: tuple[str, ...] = ("linprobe", "finetune", "coco", "ade20k")
# The ``evaluation`` fields each task reads (besides the model): its cache key and its folder hold these only,
# so a change to one task's settings re-runs that task alone. Where the jobs run (``device``, ``num_workers``)
# is among them: other hardware gives other rounding, and public jobs are deterministic for their config.
_RUNS_ON = ("device", "random_init_baseline", "batch_size", "seed", "encoder_weights")
_TRAINS_ON = (*_RUNS_ON, "num_workers")
EVAL_TASK_FIELDS: dict[str, tuple[str, ...]] = {
    "linprobe": ("linprobe_last_blocks", "linprobe_epochs", "linprobe_lr", "linprobe_optimizer", "linprobe_batch_size",
                 "precision", *_TRAINS_ON),
    "finetune": ("finetune_epochs", "finetune_lr", "finetune_weight_decay", "finetune_privacy", "layer_decay",
                 "finetune_drop_path", "finetune_label_smoothing", "finetune_mixup", "finetune_cutmix",
                 "finetune_randaugment", "finetune_batch_size", "precision", *_TRAINS_ON),
    "fewshot": ("linprobe_last_blocks", "fewshot_shots", "fewshot_seeds", "fewshot_l2", "precision", *_RUNS_ON),
    "coco": ("detection_epochs", "detection_img_size", "detection_channels", "detection_lr", "layer_decay",
             *_TRAINS_ON),
    "ade20k": ("segmentation_epochs", "segmentation_img_size", "segmentation_channels", "segmentation_lr",
               "segmentation_num_classes", "layer_decay", *_TRAINS_ON),
}
# Settings that change how fast a job runs, never its numbers: in no cache key.
EVAL_SPEED_FIELDS: tuple[str, ...] = ("loader_workers", "cpus_per_worker")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


class ModelConfig(_Frozen):
    """The masked autoencoder: a ViT encoder and a light ViT decoder."""

    img_size: int = Field(224, gt=0, description="side in pixels of the square input images (pre-training and "
                                                 "classification images are resized to it)")
    patch_size: int = Field(16, gt=0, description="side in pixels of a patch; img_size must be a multiple of it")
    in_chans: int = Field(3, gt=0, description="image channels (the loaders decode RGB: 3)")
    embed_dim: int = Field(768, gt=0, description="encoder width; a multiple of num_heads")
    depth: int = Field(12, gt=0, description="encoder blocks")
    num_heads: int = Field(12, gt=0, description="encoder attention heads")
    decoder_embed_dim: int = Field(512, gt=0, description="decoder width; a multiple of decoder_num_heads")
    decoder_depth: int = Field(4, gt=0, description="decoder blocks")
    decoder_num_heads: int = Field(16, gt=0, description="decoder attention heads")
    mlp_ratio: float = Field(4.0, gt=0, description="MLP hidden width over block width, in encoder and decoder")
    mask_ratio: float = Field(0.75, description="fraction of each image's patches masked; the encoder sees "
                                                "int(L * (1 - mask_ratio)) of the L patches")
    norm_pix_loss: bool = Field(False, description="regress each patch's pixels normalised by that patch's mean and "
                                                   "variance; false: the pixels as they are")

    @field_validator("mask_ratio")
    @classmethod
    def _mask_ratio_open_interval(cls, value: float) -> float:
        if not 0.0 < value < 1.0:
            raise ValueError(f"must lie strictly between 0 and 1, got {value}")
        return value

    @model_validator(mode="after")
    def _shapes_fit(self) -> "ModelConfig":
        if self.img_size % self.patch_size:
            raise ValueError(f"img_size {self.img_size} is not a multiple of patch_size {self.patch_size}")
        if self.embed_dim % self.num_heads:
            raise ValueError(f"embed_dim {self.embed_dim} is not a multiple of num_heads {self.num_heads}")
        if self.decoder_embed_dim % self.decoder_num_heads:
            raise ValueError(
                f"decoder_embed_dim {self.decoder_embed_dim} is not a multiple of "
                f"decoder_num_heads {self.decoder_num_heads}"
            )
        return self

    @property
    def num_patches(self) -> int:
        return (self.img_size // self.patch_size) ** 2


ACCOUNTANT_HELP = ("bounds ε to calibrate σ and report: pld (tight), prv (tight, plus its error budget), rdp (loose; "
                   "the paper's)")
STRICT_FLOAT32_HELP = ("IEEE float32 per-sample norms and clipped sums instead of the GPU's tensor cores under a "
                       "stated rounding bound (docs/privacy.md, rule 12): slower, the same guarantee")


class PrivacyConfig(_Frozen):
    """DP-SGD settings for the private stage. σ is calibrated to ``target_epsilon`` unless given.

    ``target_epsilon`` is the budget of the private data set: every run charged to its ledger composed.
    """

    enabled: bool = Field(True, description="DP-SGD in the private stage; false: it trains without privacy and the "
                                            "data set's ledger is charged ε = ∞")
    target_epsilon: float = Field(8.0, gt=0, description="budget of the private data set, all its runs composed")
    delta: float | None = Field(None, gt=0, lt=1, description="None: 1/(2N) for the measured N")
    max_grad_norm: float = Field(0.1, gt=0, allow_inf_nan=False,
                                 description="C: each sample's gradient over every trained parameter is clipped to "
                                             "this L2 norm; the noise's std is σC")
    noise_multiplier: float | None = Field(None, allow_inf_nan=False,
                                           description="None: calibrated by the accountant")
    accountant: Accountant = Field("pld", description=ACCOUNTANT_HELP)
    secure_mode: bool = Field(False, description="draw noise, samples and masks from the OS CSPRNG (slower)")
    strict_float32: bool = Field(False, description=STRICT_FLOAT32_HELP)
    log_private_statistics: bool = Field(
        False, description="log the per-step loss and images/s of the private stage (computed from private data, "
                           "not privatized) to MLflow and result.json; keep off on a shared server")

    @field_validator("noise_multiplier")
    @classmethod
    def _sigma_not_negative(cls, value: float | None) -> float | None:
        if value is not None and value < 0:
            raise ValueError(f"must be >= 0, got {value}")
        return value


class IngestConfig(_Frozen):
    """Web-image ingestion: download, filter, deduplicate, decontaminate."""

    image_size: int = Field(256, gt=0, description="side in pixels of the square images written to the shards: the "
                                                   "shorter side scaled to it, the centre cut out")
    processes: int = Field(1, gt=0, description="img2dataset's download processes (url lists)")
    threads: int = Field(8, gt=0, description="download threads per img2dataset process (url lists)")
    timeout_s: float = Field(5.0, gt=0, description="seconds before a download is abandoned (failed, not retried)")
    min_side: int = Field(32, ge=1, description="images whose original shorter side is below this, in pixels, are "
                                               "filtered out")
    max_aspect_ratio: float = Field(3.0, ge=1.0, description="images whose long side over short side exceeds this "
                                                            "are filtered out")
    drop_nsfw: bool = Field(True, description="filter out url-list rows tagged NSFW in an NSFW column, or with punsafe "
                                              "above max_punsafe")
    conditions: tuple[str, ...] = Field((), description="extra row filters, e.g. 'similarity >= 0.28'")
    phash_max_distance: int = Field(4, ge=0, le=64, description="an image within this many bits (64-bit pHash) of an "
                                                               "earlier kept one is a near duplicate, dropped")
    decontaminate_max_distance: int = Field(6, ge=0, le=64, description="an image within this many pHash bits of an "
                                                                       "evaluation image is dropped")
    respect_noai: bool = Field(True, description="refuse images served with X-Robots-Tag noai, noimageai, noindex or "
                                                 "noimageindex (url lists)")
    samples_per_shard: int = Field(1000, gt=0, description="input rows (urls or image files) per shard")
    max_punsafe: float = Field(0.5, ge=0, le=1, description="drop_nsfw also drops rows with punsafe above this")
    max_image_pixels: int = Field(89_478_485, gt=0, description="larger images are refused as decompression bombs")
    distributor: Distributor = Field(
        "multiprocessing", description="where the shards are downloaded and cleaned: this machine, or the Ray cluster "
        "(RAY_ADDRESS, else a local Ray)")
    rows_per_partition: int = Field(1_000_000, gt=0, description="images per deduplication partition (memory per task)")

    @field_validator("conditions")
    @classmethod
    def _conditions_parse(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        from vip_core.data.filters import parse_condition

        for text in value:
            parse_condition(text)
        return value


class RenderConfig(_Frozen):
    """Synthetic images from procedural shader programs (Shaders21k-style)."""

    num_images: int = Field(2000, gt=0, description="images to render (one that none of its 16 program draws "
                                                    "renders is left out)")
    size: int = Field(64, gt=0, description="side in pixels of the square rendered images")
    seed: int = Field(0, description="seed of the program order, times and mixups drawn (the images follow from it); "
                                     "must be >= 0")
    mixup: int = Field(0, ge=0, description="K > 1: convex mixup of K images (Shaders21k-6mixup: 6)")
    workers: int = Field(1, gt=0, description="render processes, one OpenGL context each; 1: in this process")
    samples_per_shard: int = Field(1000, gt=0, description="images per shard")
    images_per_program: int = Field(
        50, gt=0, description="images rendered per compiled program draw (Shaders21k: 21k programs x 50)"
    )
    num_programs: int = Field(21_000, gt=0, description="size of the generator's program pool")


class DataConfig(_Frozen):
    """Where the data comes from and how it is prepared."""

    ingest: IngestConfig = Field(IngestConfig(), description="the private images: a url list downloaded, or image "
                                                             "files, cleaned into shards")
    render: RenderConfig = Field(RenderConfig(), description="the synthetic images of the first pre-training stage")


class TrainingConfig(_Frozen):
    """One pre-training stage. Steps are logical steps (one per logical batch)."""

    batch_size: int = Field(4096, gt=0, description="expected logical batch size B; q = B / N")
    physical_batch_size: int = Field(64, gt=0, description="microbatch bound, for memory only")
    steps: int = Field(100, gt=0, description="logical steps T; a private stage calibrates σ over T and stops before "
                                              "ε would pass target_epsilon")
    lr: float | None = Field(None, gt=0, description="None: base_lr * batch_size / 256")
    base_lr: float = Field(1.5e-4, gt=0, description="peak lr per 256 images, used when lr is None")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW's moment decays (β1, β2)")
    weight_decay: float = Field(0.05, ge=0, description="AdamW's decoupled weight decay, on weights of 2 or more "
                                                        "dimensions (not biases, norms)")
    warmup_steps: int = Field(0, ge=0, description="steps of linear warmup to the peak lr; 0: none")
    schedule: Literal["cosine", "constant"] = Field(
        "cosine", description="after warmup: cosine decay to min_lr at the last step, or constant at the peak lr")
    min_lr: float = Field(0.0, ge=0, description="the cosine schedule's final lr")
    seed: int = Field(0, description="seed of the initial weights and, when the stage is not private, of its "
                                     "sampling, masks and crops")
    checkpoint_every: int = Field(50, gt=0, description="steps between checkpoints reported to Ray Train (a restarted "
                                                        "worker group resumes there), and at the end")
    num_workers: int = Field(1, gt=0, description="Ray Train workers")
    cpus_per_worker: float = Field(1.0, gt=0, description="CPUs Ray reserves for each worker; it decodes images on "
                                                          "max(2, round(cpus_per_worker)) processes")
    use_gpu: bool = Field(False, description="one GPU per worker (NCCL); false: CPU workers (gloo)")
    precision: Literal["fp32", "bf16"] = Field(
        "fp32", description="bf16: forwards under bfloat16 autocast (weights, gradients, AdamW state stay float32)")
    augmentation: Literal["none", "rrc_flip"] = Field(
        "none", description="rrc_flip: a random resized crop and a horizontal flip per sample (the paper's recipe)")
    crop_scale: tuple[float, float] = Field((0.2, 1.0), description="rrc_flip: range of the crop's area fraction")
    crop_ratio: tuple[float, float] = Field((3 / 4, 4 / 3), description="rrc_flip: range of the crop's aspect ratio")
    augmentation_multiplicity: int = Field(
        1, gt=0, description="K views of each image (K masks, and K crops and flips with rrc_flip) averaged inside "
        "that image's loss before clipping (De et al. 2022): one clipped gradient per image, K forward passes")
    ema_decay: float = Field(
        0.0, ge=0, lt=1, description="decay d of an exponential moving average of the weights after every step, "
        "published with the checkpoint as 'ema' (post-processing of the released weights); 0: off")
    train_pos_embed: bool = Field(
        False, description="train the encoder's and decoder's position embeddings (clipped and noised like every "
        "parameter); false: the fixed sin-cos embeddings")

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in value):
            raise ValueError(f"each beta must lie in [0, 1), got {value}")
        return value

    @field_validator("crop_scale")
    @classmethod
    def _scale_is_a_fraction_range(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not 0.0 < value[0] <= value[1] <= 1.0:
            raise ValueError(f"must satisfy 0 < low <= high <= 1, got {value}")
        return value

    @field_validator("crop_ratio")
    @classmethod
    def _ratio_is_a_positive_range(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not 0.0 < value[0] <= value[1]:
            raise ValueError(f"must satisfy 0 < low <= high, got {value}")
        return value

    @model_validator(mode="after")
    def _warmup_fits(self) -> "TrainingConfig":
        if self.warmup_steps > self.steps:
            raise ValueError(f"warmup_steps {self.warmup_steps} exceeds steps {self.steps}")
        return self

    @property
    def peak_lr(self) -> float:
        return self.lr if self.lr is not None else self.base_lr * self.batch_size / 256


class FinetunePrivacyConfig(_Frozen):
    """DP fine-tuning: the fine-tuning set is treated as private and gets its own (ε, δ) guarantee.

    Poisson sampling at q = batch_size / N, per-sample clipping to ``max_grad_norm``, σ calibrated to
    ``target_epsilon`` over ``steps`` unless given; δ defaults to 1/(2N). Off by default. The fine-tuning
    job trains two encoders (the checkpoint's and the random-init baseline) on the set: σ is calibrated so
    that both runs composed, with any earlier run on the set, stay within ``target_epsilon``.
    """

    enabled: bool = Field(False, description="fine-tune under DP, the fine-tuning set treated as private; false: "
                                             "plain fine-tuning")
    target_epsilon: float = Field(8.0, gt=0, description="budget of the fine-tuning set, all its runs composed (a "
                                                         "job's random-init baseline run included)")
    delta: float | None = Field(None, gt=0, lt=1, description="None: 1/(2N) for the fine-tuning set's N")
    max_grad_norm: float = Field(1.0, gt=0, allow_inf_nan=False,
                                 description="C: each example's gradient over every trained parameter (encoder and "
                                             "head) is clipped to this L2 norm")
    noise_multiplier: float | None = Field(None, ge=0, allow_inf_nan=False,
                                           description="None: calibrated by the accountant")
    batch_size: int = Field(256, gt=0, description="expected logical batch size; q = batch_size / N")
    physical_batch_size: int = Field(64, gt=0, description="microbatch bound, for memory only")
    steps: int = Field(100, gt=0, description="logical steps of each run (in place of finetune_epochs); σ is "
                                              "calibrated over them")
    accountant: Accountant = Field("pld", description=ACCOUNTANT_HELP)
    secure_mode: bool = Field(False, description="draw noise and samples from the OS CSPRNG (slower)")
    strict_float32: bool = Field(False, description=STRICT_FLOAT32_HELP)


class EvalPair(_Frozen):
    """One evaluation of the suite: ``task`` on the data set in the folder ``data`` below the evaluation root."""

    task: EvalTask = Field(description="the evaluation run on the folder data")
    data: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="a folder below the evaluation root")

    @property
    def name(self) -> str:
        """``linprobe-imagenet``: the task, then the data set unless it is the task's offline one (``coco``)."""
        return self.task if self.data == EVAL_DATA_FOLDERS[self.task] else f"{self.task}-{self.data}"


def _pairs(*pairs: tuple[str, str]) -> tuple[EvalPair, ...]:
    return tuple(EvalPair(task=task, data=data) for task, data in pairs)


# The offline sets of ``vip eval-data``: each task on its folder.
OFFLINE_SUITE = _pairs(*EVAL_DATA_FOLDERS.items())
# The ViP paper's evaluations: linear probes on ImageNet-1k, Places-365, Places-205 and iNaturalist 2021, few-shot
# on Aircraft, Caltech-101 and CIFAR-100, fine-tuning on ImageNet-1k, COCO detection, ADE20K segmentation.
PAPER_SUITE = _pairs(
    ("linprobe", "imagenet"), ("linprobe", "places365"), ("linprobe", "places205"), ("linprobe", "inat2021"),
    ("fewshot", "aircraft"), ("fewshot", "caltech101"), ("fewshot", "cifar100"),
    ("finetune", "imagenet"), ("coco", "coco"), ("ade20k", "ade20k"),
)


class EvaluationConfig(_Frozen):
    """Downstream jobs. Evaluation data is public: it is not covered by the privacy guarantee.

    Learning rates ``linprobe_lr`` and ``finetune_lr`` are base rates per 256 examples (MAE's convention);
    ``detection_lr`` and ``segmentation_lr`` are absolute. Batch sizes are global: with ``num_workers`` Ray Train
    workers each takes its share of every batch.
    """

    tasks: tuple[EvalTask, ...] = Field(EVAL_TASKS, description="the tasks of the suite to run")
    suite: tuple[EvalPair, ...] = Field(OFFLINE_SUITE, description="the (task, data set) pairs evaluated")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: CUDA when there is a device")
    num_workers: int = Field(0, ge=0, description="Ray Train workers of each job that trains (linprobe, finetune, "
                                                  "coco, ade20k), one GPU each on CUDA; 0: the job runs in its "
                                                  "own process")
    cpus_per_worker: float = Field(1.0, gt=0, description="CPUs Ray reserves for each worker")
    loader_workers: int = Field(0, ge=0, description="image-decoding processes of each job process")
    random_init_baseline: bool = Field(True, description="also run each job on a random-init encoder of the same "
                                                         "size (doubles the cost)")
    encoder_weights: EncoderWeights = Field(
        "final", description="the checkpoint's weights evaluated: its final weights, or their moving average "
        "(ema, from a stage trained with ema_decay > 0)")
    linprobe_last_blocks: int = Field(4, gt=0, description="linprobe and fewshot features: the mean-pooled patch "
                                                           "tokens of the encoder's last k blocks, concatenated")
    linprobe_epochs: int = Field(10, gt=0, description="epochs of the linear probe on frozen features")
    linprobe_lr: float = Field(0.1, gt=0, description="the probe's base lr per 256 examples")
    linprobe_optimizer: Literal["lars", "sgd"] = Field(
        "lars", description="the probe's optimizer: LARS (MAE's) or SGD, momentum 0.9, no weight decay")
    linprobe_batch_size: int | None = Field(None, gt=0, description="None: batch_size")
    finetune_epochs: int = Field(5, gt=0, description="epochs of fine-tuning (DP fine-tuning takes "
                                                      "finetune_privacy.steps instead)")
    finetune_lr: float = Field(1e-3, gt=0, description="fine-tuning AdamW's base lr per 256 examples, layer-decayed "
                                                       "down the encoder")
    finetune_weight_decay: float = Field(0.05, ge=0, description="fine-tuning AdamW's weight decay (not on biases, "
                                                                 "norms, tokens)")
    finetune_batch_size: int | None = Field(None, gt=0, description="None: batch_size")
    finetune_privacy: FinetunePrivacyConfig = Field(
        FinetunePrivacyConfig(), description="DP fine-tuning, off by default: the fine-tuning set gets its own ε, δ")
    finetune_drop_path: float = Field(0.0, ge=0, lt=1, description="stochastic depth of the last block (linear "
                                                                   "from 0 at the first)")
    finetune_label_smoothing: float = Field(0.0, ge=0, lt=1, description="label smoothing of the fine-tuning "
                                                                        "targets; 0: off")
    finetune_mixup: float = Field(0.0, ge=0, description="mixup's Beta alpha, 0: off (left off in DP fine-tuning)")
    finetune_cutmix: float = Field(0.0, ge=0, description="cutmix's Beta alpha, 0: off (left off in DP fine-tuning)")
    finetune_randaugment: int = Field(0, ge=0, le=10, description="RandAugment's magnitude (of 10), 2 operations "
                                                                 "per training image; 0: off")
    layer_decay: float = Field(0.75, gt=0, le=1, description="finetune, coco, ade20k: encoder layer l learns at lr * "
                                                            "layer_decay^(depth + 1 - l); 1: no decay")
    fewshot_shots: tuple[int, ...] = Field((1, 5, 10), description="training images per class (k) of the few-shot "
                                                                   "classifiers, one result per k")
    fewshot_seeds: int = Field(3, gt=0, description="draws of the k images per class; mean and std over them")
    fewshot_l2: float = Field(1.0, gt=0, description="ridge penalty on standardised features")
    batch_size: int = Field(64, gt=0, description="batch of feature extraction, scoring, coco and ade20k; linprobe's "
                                                  "and finetune's when theirs is None")
    detection_epochs: int = Field(2, gt=0, description="epochs of the COCO detector's end-to-end training")
    detection_img_size: int = Field(1024, gt=0, description="side in pixels of the square detection inputs; a "
                                                            "multiple of 2 x patch_size")
    detection_channels: int = Field(256, gt=0, description="width of the detector's feature pyramid and heads")
    detection_lr: float = Field(1e-4, gt=0, description="the detector AdamW's peak lr (absolute), layer-decayed down "
                                                        "the encoder")
    segmentation_epochs: int = Field(2, gt=0, description="epochs of the ADE20K segmenter's end-to-end training")
    segmentation_img_size: int = Field(512, gt=0, description="side in pixels of the square segmentation inputs; a "
                                                              "multiple of 2 x patch_size")
    segmentation_channels: int = Field(256, gt=0, description="width of the segmenter's feature pyramid and head")
    segmentation_lr: float = Field(1e-4, gt=0, description="the segmenter AdamW's peak lr (absolute), layer-decayed "
                                                           "down the encoder")
    segmentation_num_classes: int | None = Field(150, gt=0, description="None: the largest training label")
    precision: Literal["fp32", "bf16"] = Field("fp32", description="feature extraction and fine-tuning forwards "
                                                                   "under bf16 autocast or not")
    seed: int = Field(0, description="seed of the jobs' heads, batch orders, augmentations, few-shot draws and "
                                     "random-init encoder")

    @field_validator("suite")
    @classmethod
    def _pairs_once(cls, value: tuple[EvalPair, ...]) -> tuple[EvalPair, ...]:
        names = [pair.name for pair in value]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"pairs listed twice: {', '.join(repeated)}")
        return value

    @model_validator(mode="after")
    def _batches_split_over_workers(self) -> "EvaluationConfig":
        if self.num_workers > 1:
            for field in ("batch_size", "linprobe_batch_size", "finetune_batch_size"):
                size = getattr(self, field)
                if size is not None and size % self.num_workers:
                    raise ValueError(f"{field} {size} is not a multiple of num_workers {self.num_workers}: each "
                                     "worker takes an equal share of every batch")
        return self

    @property
    def pairs(self) -> tuple[EvalPair, ...]:
        """The pairs of the suite whose task is in ``tasks``."""
        return tuple(pair for pair in self.suite if pair.task in self.tasks)


class VipConfig(_Frozen):
    """A whole pipeline run: model, data, the two pre-training stages, privacy and evaluation."""

    name: str = Field("vip", description="the run's name: the flows' default workdir is $VIP_HOME/runs/NAME; "
                                         "recorded in results and exports")
    model: ModelConfig = Field(ModelConfig(), description="the masked autoencoder: its shape and mask ratio")
    privacy: PrivacyConfig = Field(PrivacyConfig(), description="DP-SGD of the private stage: budget, clipping, noise, "
                                                                "accountant")
    data: DataConfig = Field(DataConfig(), description="ingestion of the private images, rendering of the synthetic "
                                                       "ones")
    synthetic: TrainingConfig = Field(TrainingConfig(), description="the first pre-training stage, on the rendered "
                                                                    "images, without DP")
    private: TrainingConfig = Field(TrainingConfig(), description="the DP stage on the ingested images "
                                                                  "(privacy.enabled); the pipeline starts it from "
                                                                  "synthetic's checkpoint")
    evaluation: EvaluationConfig = Field(EvaluationConfig(), description="the downstream jobs run on the checkpoint")

    @model_validator(mode="after")
    def _stage_batches(self) -> "VipConfig":
        for stage in ("synthetic", "private"):
            training: TrainingConfig = getattr(self, stage)
            if training.physical_batch_size > training.batch_size:
                raise ValueError(
                    f"{stage}.physical_batch_size {training.physical_batch_size} exceeds "
                    f"{stage}.batch_size {training.batch_size}"
                )
        return self


# ----------------------------------------------------------------------------------------------- presets

_DECODER = dict(decoder_embed_dim=512, decoder_depth=4, decoder_num_heads=16)


def _paper_model(embed_dim: int, depth: int = 12, num_heads: int = 12) -> ModelConfig:
    return ModelConfig(img_size=224, patch_size=16, embed_dim=embed_dim, depth=depth, num_heads=num_heads, **_DECODER)


def _paper_private_stage(**overrides: Any) -> TrainingConfig:
    recipe = dict(
        batch_size=98_304, physical_batch_size=128, steps=6_000, base_lr=1.5e-5, betas=(0.9, 0.95),
        weight_decay=0.005, warmup_steps=120, schedule="cosine", checkpoint_every=100,
        num_workers=8, use_gpu=True, precision="bf16", augmentation="rrc_flip",
    )
    return TrainingConfig(**{**recipe, **overrides})


def _paper_synthetic_stage() -> TrainingConfig:
    return TrainingConfig(
        batch_size=4_096, physical_batch_size=256, steps=10_000, base_lr=1.5e-4, weight_decay=0.05,
        warmup_steps=400, checkpoint_every=500, num_workers=8, use_gpu=True, precision="bf16",
        augmentation="rrc_flip",
    )


def _paper_evaluation(depth: int) -> EvaluationConfig:
    """The official MAE/ViP evaluation recipes: a LARS linear probe (base lr 0.1, batch 16,384, 90 epochs) on every
    block's pooled features; fine-tuning for 100 epochs at base lr 5e-4, batch 1,024, layer decay 0.65, drop path
    0.1, mixup 0.8, cutmix 1.0, label smoothing 0.1, RandAugment at magnitude 9 (docs/pretraining.md lists what is
    left out); the paper's suite on 8 GPU workers in bf16, without the random-init baseline."""
    return EvaluationConfig(
        suite=PAPER_SUITE, device="cuda", num_workers=8, cpus_per_worker=10.0, loader_workers=10,
        random_init_baseline=False, precision="bf16",
        linprobe_last_blocks=depth, linprobe_epochs=90, linprobe_lr=0.1, linprobe_optimizer="lars",
        linprobe_batch_size=16_384, finetune_batch_size=1_024,
        finetune_epochs=100, finetune_lr=5e-4, finetune_weight_decay=0.05, layer_decay=0.65,
        finetune_drop_path=0.1, finetune_mixup=0.8, finetune_cutmix=1.0, finetune_label_smoothing=0.1,
        finetune_randaugment=9,
    )


def _paper_preset(name: str, model: ModelConfig) -> VipConfig:
    return VipConfig(
        name=name,
        model=model,
        privacy=PrivacyConfig(target_epsilon=8.0, max_grad_norm=0.1, accountant="pld"),
        data=DataConfig(ingest=IngestConfig(image_size=256), render=RenderConfig(num_images=21_000 * 50, size=256)),
        synthetic=_paper_synthetic_stage(),
        private=_paper_private_stage(),
        evaluation=_paper_evaluation(model.depth),
    )


def tiny() -> VipConfig:
    """A CPU demo: 32 px images, patch 4, a narrow shallow ViT; minutes on two cores."""
    model = ModelConfig(
        img_size=32, patch_size=4, embed_dim=64, depth=2, num_heads=4,
        decoder_embed_dim=32, decoder_depth=1, decoder_num_heads=4, mask_ratio=0.75,
    )
    cpu_stage = dict(physical_batch_size=32, base_lr=1.5e-3, warmup_steps=2, checkpoint_every=5, cpus_per_worker=0.5)
    return VipConfig(
        name="tiny",
        model=model,
        privacy=PrivacyConfig(target_epsilon=8.0, max_grad_norm=1.0, accountant="pld"),
        data=DataConfig(
            ingest=IngestConfig(image_size=32, min_side=16),
            render=RenderConfig(num_images=256, size=32, images_per_program=8),
        ),
        synthetic=TrainingConfig(batch_size=64, steps=20, **cpu_stage),
        private=TrainingConfig(batch_size=64, steps=10, weight_decay=0.005, **cpu_stage),
        evaluation=EvaluationConfig(
            linprobe_epochs=5, finetune_epochs=2, finetune_lr=0.02, fewshot_seeds=2, batch_size=64,
            detection_epochs=1, segmentation_epochs=1, linprobe_last_blocks=2,
            linprobe_optimizer="sgd", detection_img_size=64, detection_channels=32,
            segmentation_img_size=64, segmentation_channels=32, segmentation_num_classes=None,
        ),
    )


def vip_pico() -> VipConfig:
    """The CPU experiment of ``make reproduce``: 32 px, patch 4, a 4-block 128-wide ViT, a 64-wide 2-block decoder,
    norm_pix_loss; a synthetic stage of 1,000 steps at lr 1e-3 (150 steps made the features worse than random
    ones) and a DP stage whose fresh AdamW warms up to 1e-3 over 10 steps (a higher peak destroys the warm
    start), C = 0.1, ε = 8 (sizes set by the experiment: docs/reproduce.md)."""
    model = ModelConfig(
        img_size=32, patch_size=4, embed_dim=128, depth=4, num_heads=4,
        decoder_embed_dim=64, decoder_depth=2, decoder_num_heads=4, mask_ratio=0.75, norm_pix_loss=True,
    )
    cpu_stage = dict(physical_batch_size=128, cpus_per_worker=0.5)
    return VipConfig(
        name="vip-pico",
        model=model,
        privacy=PrivacyConfig(target_epsilon=8.0, max_grad_norm=0.1, accountant="pld"),
        data=DataConfig(render=RenderConfig(num_images=16_000, size=64, images_per_program=50)),
        synthetic=TrainingConfig(batch_size=128, steps=1000, lr=1e-3, warmup_steps=50, weight_decay=0.05,
                                 checkpoint_every=250, **cpu_stage),
        private=TrainingConfig(batch_size=1024, steps=16, lr=1e-3, warmup_steps=10, weight_decay=0.005,
                               checkpoint_every=8, **cpu_stage),
        evaluation=EvaluationConfig(linprobe_last_blocks=4),
    )


def vip_nano() -> VipConfig:
    """ViP-Nano: 192-wide encoder."""
    return _paper_preset("vip-nano", _paper_model(192))


def vip_tiny() -> VipConfig:
    """ViP-Tiny: 384-wide encoder."""
    return _paper_preset("vip-tiny", _paper_model(384))


def vip_small() -> VipConfig:
    """ViP-Small: 576-wide encoder."""
    return _paper_preset("vip-small", _paper_model(576))


def vip_base() -> VipConfig:
    """ViP-Base: 768-wide encoder, the paper's default."""
    return _paper_preset("vip-base", _paper_model(768))


def vip_large() -> VipConfig:
    """ViP-Large: 1024-wide, 24-block encoder."""
    return _paper_preset("vip-large", _paper_model(1024, depth=24, num_heads=16))


def vip_base_paper() -> VipConfig:
    """The published ViP-Base recipe: 224 px, patch 16, mask 0.75, DP-AdamW (0.9, 0.95), wd 0.005,
    C = 0.1, B = 98,304, T = 6,000, δ = 1/(2N), warmup then cosine, and the paper's noise σ = 0.48 with the
    RDP accountant it reports (ε 7.99 on LAION-233M; PLD gives 6.83 for the same σ). ``vip-base`` instead
    calibrates σ by PLD to ε = 8: less noise for the same guarantee."""
    return with_overrides(_paper_preset("vip-base-paper", _paper_model(768)),
                          {"privacy.noise_multiplier": 0.48, "privacy.accountant": "rdp"})


def dp_finetune_imagenet() -> FinetunePrivacyConfig:
    """DP fine-tuning at the paper's ImageNet-1K setting: ε = 8, δ = 8e-7 (other fields: our defaults).

    Use as ``evaluation.finetune_privacy`` or ``vip eval --task finetune --dp-finetune imagenet``.
    """
    return FinetunePrivacyConfig(enabled=True, target_epsilon=8.0, delta=8e-7)


DP_FINETUNE_PRESETS: dict[str, Callable[[], FinetunePrivacyConfig]] = {"imagenet": dp_finetune_imagenet}


PRESETS: dict[str, Callable[[], VipConfig]] = {
    "tiny": tiny,
    "vip-pico": vip_pico,
    "vip-nano": vip_nano,
    "vip-tiny": vip_tiny,
    "vip-small": vip_small,
    "vip-base": vip_base,
    "vip-large": vip_large,
    "vip-base-paper": vip_base_paper,
}


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the field."""


def get_preset(name: str) -> VipConfig:
    """The preset called ``name``; an unknown name raises :class:`ConfigError` listing the known ones."""
    try:
        return PRESETS[name]()
    except KeyError:
        raise ConfigError(f"preset: unknown preset {name!r} (known: {', '.join(PRESETS)})") from None


def with_overrides(config: VipConfig, overrides: Mapping[str, Any]) -> VipConfig:
    """A copy of ``config`` with dotted-path ``overrides`` (``{"private.steps": 5}``), validated again."""
    data = config.model_dump()
    for dotted, value in overrides.items():
        _merge(data, _nested(dotted, value))
    return validate_config(data)


def resolve_config(preset: str, *, file: str | Path | None = None, overrides: Mapping[str, Any] | None = None,
                   settings: Sequence[str] = ()) -> VipConfig:
    """The config a command runs on: each layer changes the fields it names and a later layer wins.

    Args:
        preset: the preset's name, the first layer.
        file: a config file of some or all fields (:func:`read_config_file`).
        overrides: dotted fields a command's own flags set (``{"private.steps": 5}``).
        settings: ``FIELD=VALUE`` texts (:func:`parse_setting`), applied last.

    Raises:
        ConfigError: one line naming the unknown field, the bad value's field, the malformed setting or the file.
    """
    data = get_preset(preset).model_dump()
    if file is not None:
        _merge(data, read_config_file(file))
    for dotted, value in [*(overrides or {}).items(), *map(parse_setting, settings)]:
        _merge(data, _nested(dotted, value))
    return validate_config(data)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The fields a YAML (``.yaml``, ``.yml``), TOML or JSON config file sets, as nested sections.

    Raises:
        ConfigError: the file cannot be read, is not valid in its format, or does not hold a mapping.
    """
    path = Path(path)
    loader = _FILE_LOADERS.get(path.suffix.lower())
    if loader is None:
        raise ConfigError(f"config file {path}: the name must end in {', '.join(_FILE_LOADERS)}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"config file {path}: cannot be read ({getattr(error, 'strerror', None) or error})") from None
    try:
        data = loader(text)
    except (yaml.YAMLError, tomllib.TOMLDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"config file {path}: not valid {path.suffix.lstrip('.').upper()}: "
                          f"{_parse_problem(error)}") from None
    if data is None:  # an empty YAML file changes nothing
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: holds a {type(data).__name__}, not sections of fields")
    return data


_FILE_LOADERS: dict[str, Callable[[str], Any]] = {
    ".yaml": yaml.safe_load, ".yml": yaml.safe_load, ".toml": tomllib.loads, ".json": json.loads,
}


def parse_setting(text: str) -> tuple[str, Any]:
    """``privacy.target_epsilon=4`` as ``("privacy.target_epsilon", 4)``, the value read as YAML: ``4``, ``true``,
    ``null``, ``[linprobe, coco]`` and ``'"2024"'`` (a quoted text) take their types.

    Raises:
        ConfigError: no ``=``, no field name, or a value YAML cannot read.
    """
    field, equals, value = text.partition("=")
    if not equals or not field.strip():
        raise ConfigError(f"malformed setting {text!r}: expected FIELD=VALUE, such as privacy.target_epsilon=4")
    try:
        return field.strip(), yaml.safe_load(value)
    except yaml.YAMLError as error:
        raise ConfigError(f"setting {field.strip()}: cannot read the value {value!r} ({_parse_problem(error)})") from None


def _parse_problem(error: Exception) -> str:
    """A parser's complaint on one line; YAML's own spans several, quoting the text."""
    if isinstance(error, yaml.MarkedYAMLError) and error.problem_mark is not None:
        mark = error.problem_mark
        return f"{error.problem} (line {mark.line + 1}, column {mark.column + 1})"
    return " ".join(str(error).split())


def config_yaml(config: VipConfig) -> str:
    """The whole config as YAML, sections in the models' order; :func:`read_config_file` reads it back."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False, width=120)


def _nested(dotted: str, value: Any) -> dict[str, Any]:
    """``("a.b", 1)`` as ``{"a": {"b": 1}}``."""
    for key in reversed(dotted.split(".")):
        value = {key: value}
    return value


def _merge(data: dict[str, Any], patch: Mapping[Any, Any], prefix: str = "") -> None:
    """Writes ``patch`` into the dumped config ``data``, section into section; a key that is not a field of its
    section raises :class:`ConfigError` naming it."""
    for key, value in patch.items():
        dotted = f"{prefix}{key}"
        if key not in data:
            raise _unknown_field(dotted, data)
        if isinstance(data[key], dict) and isinstance(value, Mapping):
            _merge(data[key], value, f"{dotted}.")
        elif isinstance(value, Mapping) and value:  # no field holds a mapping: the keys were meant as fields
            raise ConfigError(f"unknown config field {dotted}.{next(iter(value))} ({dotted} is a value, not a section)")
        else:
            data[key] = value


def _unknown_field(dotted: str, known: Iterable[str]) -> ConfigError:
    """``unknown config field privacy.target_epsilonn (did you mean privacy.target_epsilon?)``, or the section's
    fields when none is close."""
    section, _, name = dotted.rpartition(".")
    prefix = f"{section}." if section else ""
    close = difflib.get_close_matches(str(name), list(known), n=1)
    hint = f"did you mean {prefix}{close[0]}?" if close else f"{section or 'the config'} has: {', '.join(known)}"
    return ConfigError(f"unknown config field {dotted} ({hint})")


def validate_config(data: dict[str, Any]) -> VipConfig:
    """Builds a :class:`VipConfig`, turning pydantic's report into a one-line :class:`ConfigError`."""
    try:
        return VipConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(describe_validation_error(error)) from None


def describe_validation_error(error: ValidationError) -> str:
    """One line per problem, each led by the dotted field name: ``privacy.noise_multiplier: must be >= 0``."""
    parts = []
    for problem in error.errors():
        field = ".".join(str(p) for p in problem["loc"]) or "config"
        message = problem["msg"].removeprefix("Value error, ")
        parts.append(f"{field}: {message}")
    return "; ".join(parts)


def flatten(config: BaseModel, prefix: str = "") -> dict[str, str]:
    """Dotted-key string params for MLflow: ``{"privacy.max_grad_norm": "0.1", ...}``."""
    flat: dict[str, str] = {}
    for key, value in config.model_dump(mode="json").items():
        _flatten_into(flat, f"{prefix}{key}", value)
    return flat


def _flatten_into(flat: dict[str, str], key: str, value: Any) -> None:
    if isinstance(value, dict):
        for child, child_value in value.items():
            _flatten_into(flat, f"{key}.{child}", child_value)
    else:
        flat[key] = str(value)
