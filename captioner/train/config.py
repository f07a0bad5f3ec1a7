"""What `fit` is asked to do, grouped by concern, and where a run is.

Each field is also `fit`'s option, each group a section of `fit --help`. A field whose default depends on other
settings is None until `train.resume.settle` settles it; the settled configs travel in every checkpoint.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Annotated, Literal

from captioner.errors import OptionError
from captioner.objectives.objective import HardAttentionConfig
from captioner.objectives.scst import ScstConfig
from captioner.objectives.terms import TermsConfig
from captioner.options import check_positive
from captioner.train.finetune import FineTuneConfig

XE_LR = 1e-3  # Adam's learning rate for cross-entropy training


@dataclass(frozen=True)
class OptimConfig:
    """Optimisation: batches, Adam and precision."""

    batch_size: Annotated[int, "captions per step and process (scst: images, each sampled --samples times)"] = 32
    lr: Annotated[float | None, "Adam learning rate"] = None
    grad_clip: Annotated[float, "clip the gradients' total norm to this"] = 5.0
    ema: Annotated[
        float,
        "most of the decoder's weights' moving average that each step keeps: validation scores the average and "
        "checkpoints hold it (after step t it keeps min(EMA, (1+t)/(10+t)); 0: off)",
    ] = 0.999
    seed: Annotated[int, "seed of the run: initial weights, batch order, dropout, and the familiarity's sample"] = 0
    amp: Annotated[
        Literal["none", "tf32", "bf16", "fp16"],
        "precision: none (float32), tf32 (float32 with TF32 matmuls on GPUs that have them), bf16 or fp16 "
        "(autocast; fp16 adds a gradient scaler on CUDA)",
    ] = "none"

    def __post_init__(self):
        check_positive(self, "batch_size", "lr", "grad_clip")
        if not 0 <= self.ema < 1:
            raise OptionError(f"--ema is a decay from 0 (off) to below 1, got {self.ema}")


@dataclass(frozen=True)
class ScheduleConfig:
    """Schedule: how long to train, when to validate and stop."""

    cooldown: Annotated[
        float,
        "share of the --max-minutes budget, at its end, over which the learning rate falls linearly to 0 "
        "(0: off; the rate then only halves when validation stalls)",
    ] = 0.0
    patience: Annotated[int, "validations without improvement before stopping early"] = 8
    metric: Annotated[Literal["CIDEr", "BLEU-4"], "validation score that chooses best.pt and stops early"] = "CIDEr"
    val_beam_size: Annotated[int, "beam size of the validation captions (1: greedy)"] = 3
    val_images: Annotated[int | None, "validation images per epoch"] = 5000

    def __post_init__(self):
        check_positive(self, "patience", "val_beam_size", "val_images")
        if not 0 <= self.cooldown <= 1:
            raise OptionError(f"--cooldown is a share of the time budget, from 0 to 1, got {self.cooldown}")


@dataclass(frozen=True)
class ProcessConfig:
    """How this process runs the training: how far, shapes, compile, workers, logging and saving.
    A resumed run takes these from its own command line."""

    epochs: Annotated[int, "passes over the training captions"] = 30
    max_minutes: Annotated[float | None, "stop at a step boundary after this long, then validate and save"] = None
    shapes: Annotated[
        Literal["auto", "packed", "fixed"],
        "packed: each batch as long as its longest caption, finished captions dropped step by step (fast on "
        "CPUs); fixed: every batch padded to its length bucket, with masks, so a step has the same shapes each "
        "time and no host synchronisation (GPUs: compiled); auto: packed on CPUs, fixed on GPUs",
    ] = "auto"
    compile: Annotated[
        bool,
        "torch.compile the training step on any device (trains with fixed shapes; a GPU compiles it anyway, "
        "unless --cuda-graphs off)",
    ] = False
    cuda_graphs: Annotated[
        Literal["auto", "off"],
        "auto: on a GPU, compile each fixed-shape step and the validation's search with "
        'torch.compile(mode="reduce-overhead"), which replays them as CUDA graphs, going on eagerly with a '
        "warning where a compile fails; off: neither (--compile still compiles, without graphs)",
    ] = "auto"
    workers: Annotated[
        int, "DataLoader workers decoding images (--fine-tune-encoder: the pool4 cache, conv4_1 batches)"
    ] = 2
    checkpoint_every: Annotated[int, "also write last.pt every N steps (0: off)"] = 0
    checkpoint_minutes: Annotated[
        float,
        "also write last.pt when this many minutes have passed since the last save (0: off), so a killed run "
        "loses at most that much",
    ] = 0.5
    log_every: Annotated[int, "steps between log lines (the loss is read back from the device then)"] = 20
    tensorboard: Annotated[
        str | None,
        "also write the log as TensorBoard event files in this folder (rank 0): the losses, learning rate, "
        "steps per second, validation scores and attention health, and at each validation a few images' captions "
        "and attention maps; a resumed run given it again goes on in it (needs the [train] extra's tensorboard)",
    ] = None

    def __post_init__(self):
        check_positive(self, "epochs", "max_minutes", "log_every")
        if self.workers < 0:
            raise OptionError(f"--workers must be 0 or more, got {self.workers}")


@dataclass(frozen=True)
class TrainConfig:
    """Everything `fit` is asked to do but the model's sizes; saved in every checkpoint."""

    objective: Annotated[
        Literal["xe", "scst"],
        "xe: cross-entropy; scst: self-critical training on CIDEr-D, from --init or --resume "
        "(a resumed run keeps its own objective)",
    ] = "xe"
    optim: OptimConfig = field(default_factory=OptimConfig)
    process: ProcessConfig = field(default_factory=ProcessConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    terms: TermsConfig = field(default_factory=TermsConfig)
    hard: HardAttentionConfig = field(default_factory=HardAttentionConfig)
    fine_tune: Annotated[
        FineTuneConfig | None,
        "--fine-tune-encoder",
        "train the encoder's last layers with the decoder (the checkpoint then holds them under encoder_state); "
        "conv5_1 first caches pool4 outputs in the data directory, once",
    ] = None
    scst: ScstConfig = field(default_factory=ScstConfig)

    def __post_init__(self):
        if self.objective not in ("xe", "scst"):
            raise OptionError(f"--objective must be 'xe' or 'scst', got {self.objective!r}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        """The config a checkpoint of the current version records (`models.checkpoint` migrates older ones)."""
        kw = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        kw.update({name: group(**d.get(name, {})) for name, group in GROUPS.items()})
        kw["fine_tune"] = FineTuneConfig(**d["fine_tune"]) if d.get("fine_tune") else None
        return cls(**kw)

    @classmethod
    def of(cls, **settings) -> TrainConfig:
        """A config from settings named as their options are, each put in its group:
        `TrainConfig.of(epochs=2, lr=3e-3, alpha_c=0)`, for scripts and tests."""
        grouped: dict = {name: {} for name in GROUPS}
        for key, value in settings.items():
            group = next((name for name, g in GROUPS.items() if key in {f.name for f in fields(g)}), None)
            if group is None:
                grouped[key] = value  # objective, fine_tune, or a whole group
            else:
                grouped[group][key] = value
        return cls(**{k: GROUPS[k](**v) if k in GROUPS and isinstance(v, dict) else v for k, v in grouped.items()})


def _groups(cls) -> dict[str, type]:
    """The config's groups (its fields that are always a config class), each field name in one group only:
    `TrainConfig.of` and the command line find a setting's group by its name."""
    groups = {f.name: f.default_factory for f in fields(cls) if f.default_factory is not MISSING}
    owner: dict[str, str] = {}
    for name, group in groups.items():
        for f in fields(group):
            if f.name in owner:
                raise TypeError(f"{cls.__name__}: the setting {f.name!r} is in both {owner[f.name]} and {name}")
            owner[f.name] = name
    return groups


GROUPS = _groups(TrainConfig)


@dataclass
class Progress:
    """Where training is; part of every checkpoint."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    best: float = -math.inf
    best_step: int = 0
    best_healthy: bool = False  # best.pt's attention passed the health check
    stale: int = 0  # validations since the last improvement
    skipped_steps: int = 0  # steps not applied: a non-finite loss or gradient
    skipped_captions: int = 0  # captions left out, features not finite (rank 0's share)
    cooldown_from: list[float] | None = None  # each parameter group's learning rate when the cooldown began
