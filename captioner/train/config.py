"""Training settings and progress: what `fit` is asked to do, and where it is.

Both travel in every checkpoint (`TrainConfig.to_dict`, `Progress` as a dict), so a resumed run
continues as it was configured, from where it was.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Annotated, Literal

from captioner.objectives.reinforce import HardAttentionConfig
from captioner.objectives.scst import LR as SCST_LR
from captioner.objectives.scst import ScstConfig
from captioner.train.finetune import DECODER_FIRST, FineTuneConfig


@dataclass
class TrainConfig:
    """Optimisation settings; saved in every checkpoint. Each field is also `fit`'s option."""

    epochs: Annotated[int, "passes over the training captions"] = 30
    batch_size: Annotated[int, "captions per step and process (scst: images, each sampled --samples times)"] = 32
    lr: Annotated[float | None, f"Adam learning rate (default: 1e-3 for xe, {SCST_LR:g} for scst)"] = None
    grad_clip: Annotated[float, "clip the gradients' total norm to this"] = 5.0
    alpha_c: Annotated[
        float,
        "λ of the doubly stochastic regularisation, eq. (14); the paper uses 1. With the consistency's sharp "
        "maps it moves attention between the objects a caption names; at 1 it spreads the maps evenly",
    ] = 0.3
    consistency: Annotated[
        float,
        "weight of the attention maps' consistency between each image and its view, turned 180° and moved "
        "(objectives.consistency: sharp maps that follow the content); needs the views' features prepare "
        "writes by default; 0: off",
    ] = 1.0
    consistency_share: Annotated[float, "share of each batch's captions the consistency is estimated on"] = 0.25
    boxes: Annotated[
        str | None,
        "object boxes in COCO instances format (optionally a 'color' per annotation) for the training images: "
        "caption words that name a boxed object also teach attention where it is (attention correctness)",
    ] = None
    boxes_weight: Annotated[float, "weight of the attention correctness term of --boxes"] = 10.0
    boxes_choice_weight: Annotated[
        float,
        "weight of the same term at the word the model itself would write at each step (its most likely word), "
        "where that word names an object of the image: the map of the model's own choice lies on that object "
        "(--boxes, soft attention; 0: off)",
    ] = 0.0
    paper: Annotated[
        bool,
        "--paper-objective",
        "train on the paper's objective exactly: eq. (14) with λ = 1 and no attention term of ours "
        "(sets --alpha-c 1 and --consistency 0)",
    ] = False
    max_minutes: Annotated[float | None, "stop at a step boundary after this long, then validate and save"] = None
    cooldown: Annotated[
        float,
        "share of the --max-minutes budget, at its end, over which the learning rate falls linearly to 0 "
        "(0: off, the rate only halves when validation stalls; 0.2 did not bring 8-minute runs' captions "
        "closer to the paper objective's: docs/results.md)",
    ] = 0.0
    ema: Annotated[
        float,
        "most of the decoder's weights' moving average that each step keeps: validation scores the average "
        "and checkpoints hold it (train.averaging; after step t it keeps min(EMA, (1+t)/(10+t)); 0: off)",
    ] = 0.999
    patience: Annotated[int, "validations without improvement before stopping early"] = 8
    metric: Annotated[Literal["CIDEr", "BLEU-4"], "validation score that chooses best.pt and stops early"] = "CIDEr"
    val_beam_size: Annotated[int, "beam size of the validation captions (1: greedy)"] = 3
    val_images: Annotated[int | None, "validation images per epoch"] = 5000
    checkpoint_every: Annotated[int, "also write last.pt every N steps (0: off)"] = 0
    checkpoint_minutes: Annotated[
        float,
        "also write last.pt when this many minutes have passed since the last "
        "save (0: off), so a killed run loses at most that much",
    ] = 0.5
    log_every: Annotated[int, "steps between log lines"] = 20
    seed: Annotated[int, "seed of the initial weights, batches and dropout"] = 0
    amp: Annotated[
        Literal["none", "bf16", "fp16"], "mixed precision (autocast); fp16 adds a gradient scaler on CUDA"
    ] = "none"
    compile: Annotated[bool, "torch.compile the decoder's recurrent step (for GPUs); trains on the plain pass"] = False
    fused: Annotated[
        bool,
        "--no-fused",
        "train soft attention on the plain autograd pass instead of the fused one (same values and gradients, slower)",
    ] = True
    hard: HardAttentionConfig = field(default_factory=HardAttentionConfig)
    fine_tune: Annotated[
        FineTuneConfig | None,
        "--fine-tune-encoder",
        "train the encoder's last layers with the "
        "decoder (the checkpoint then holds them under encoder_state); conv5_1 first caches "
        "pool4 outputs in the data directory, once",
    ] = None
    objective: Annotated[
        Literal["xe", "scst"],
        "xe: cross-entropy; scst: self-critical training on CIDEr-D, "
        "from --init or --resume (a resumed run keeps its own objective)",
    ] = "xe"
    init: Annotated[
        str | None,
        "start from this checkpoint's weights and decoder sizes, with a fresh optimizer "
        "(e.g. RUN/best.pt of a cross-entropy run)",
    ] = None
    scst: ScstConfig = field(default_factory=ScstConfig)

    def __post_init__(self):
        if self.objective not in ("xe", "scst"):
            raise ValueError(f"objective must be 'xe' or 'scst', got {self.objective!r}")
        positive = {
            "epochs": self.epochs,
            "batch_size": self.batch_size,
            "patience": self.patience,
            "val_beam_size": self.val_beam_size,
            "log_every": self.log_every,
            "grad_clip": self.grad_clip,
            "lr": self.lr,
            "max_minutes": self.max_minutes,
            "val_images": self.val_images,
        }
        for name, value in positive.items():
            if value is not None and not value > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
        if not 0 <= self.ema < 1:
            raise ValueError(f"--ema is a decay from 0 (off) to below 1, got {self.ema}")
        if not 0 <= self.cooldown <= 1:
            raise ValueError(f"--cooldown is a share of the time budget, from 0 to 1, got {self.cooldown}")
        if self.lr is None:
            self.lr = SCST_LR if self.objective == "scst" else 1e-3
        if self.paper:
            self.alpha_c, self.consistency = 1.0, 0.0
        if self.fine_tune is not None and self.fine_tune.after is None:
            self.fine_tune = replace(self.fine_tune, after=0 if self.init else DECODER_FIRST)  # not the caller's
        if self.fine_tune is not None and self.fine_tune.after < 0:
            raise ValueError(f"--tune-after is a number of epochs, got {self.fine_tune.after}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        kw = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        kw.setdefault("ema", 0.0)  # checkpoints from before --ema trained without the average
        kw.setdefault("boxes_choice_weight", 0.0)  # nor at the model's own choice of words
        kw["hard"] = HardAttentionConfig(**d.get("hard", {}))
        # Checkpoints from before --tune-after trained the encoder from the first step.
        kw["fine_tune"] = FineTuneConfig(**{"after": 0, **d["fine_tune"]}) if d.get("fine_tune") else None
        kw["scst"] = ScstConfig(**d.get("scst", {}))
        return cls(**kw)


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
    baseline: float = 0.0  # REINFORCE moving-average baseline (hard attention)
    skipped_steps: int = 0  # steps not applied: a non-finite loss or gradient
    skipped_captions: int = 0  # captions left out, features not finite (rank 0's share)
    cooldown_from: list[float] | None = None  # each parameter group's learning rate when the cooldown began
