"""The parts of a training run, built once from the settled configs (`train.settle`).

`build` makes the long-lived parts (decoder, its average, a fine-tuned encoder,
optimizer, schedule, random stream, log, checkpoints, and the objectives with their batch
sources), restoring a resumed run's state into them; `for_epoch` makes an epoch's step of the
stage it is in (until the encoder trains, the decoder's alone, on the cached features). After
`build`, the loop reads only the schedule and checkpoint groups of the config.
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import NamedTuple

import torch
from torch.nn.parallel import DistributedDataParallel

from captioner.cuda_graphs import GraphCapture
from captioner.data.batches import CaptionBatches, TrainingImages
from captioner.data.boxes import BoxTargets, GroundingBoxes
from captioner.data.dataset import CaptionData
from captioner.errors import CaptionerError
from captioner.models.decoder import AttentionDecoder, DecoderConfig
from captioner.objectives.terms import TermState
from captioner.options import command_line
from captioner.train import distributed, resilience
from captioner.train.averaging import WeightAverage
from captioner.train.checkpoints import Checkpoints, Live, RunLog
from captioner.train.config import OptimConfig, Progress, ScheduleConfig, TrainConfig
from captioner.train.familiarity import fit_stats
from captioner.train.finetune import FineTuning
from captioner.train.resume import restore
from captioner.train.stages import Stage, stage
from captioner.train.step import TrainStep, make_optimizer

log = logging.getLogger(__name__)


class Budget:
    """The run's time (`--max-minutes`, counted from the start of its log) and the cooldown at its end."""

    def __init__(self, schedule: ScheduleConfig, *, started: float):
        self.seconds = schedule.max_minutes * 60 if schedule.max_minutes else math.inf
        self.cooldown, self.started = schedule.cooldown, started

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def out(self) -> bool:
        return self.elapsed() > self.seconds

    @property
    def cools(self) -> bool:
        """The learning rate cools down at the end: there is a budget and a cooldown share of it."""
        return self.cooldown > 0 and math.isfinite(self.seconds)

    def rate_left(self, elapsed: float) -> float:
        """The share of its rate the learning rate keeps at `elapsed` seconds: 1 until the last `cooldown`
        share of the budget, then falling linearly to 0."""
        return min(1.0, max(0.0, (self.seconds - elapsed) / (self.cooldown * self.seconds)))


class Parts(NamedTuple):
    """What a run keeps from start to end."""

    data: CaptionData
    optim: OptimConfig  # how each step runs; its seed is the run's (weights, batches with the epoch, familiarity)
    d: distributed.Dist
    device: torch.device
    decoder: AttentionDecoder
    average: WeightAverage | None
    tuning: FineTuning | None
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.ReduceLROnPlateau
    generator: torch.Generator  # the terms' random draws, one stream per process
    terms: TermState  # the loss terms' own state (hard attention's baseline)
    graphs: GraphCapture | None  # the run's CUDA graphs (`--cuda-graphs auto`), sharing one memory pool
    targets: BoxTargets | None
    log: RunLog
    budget: Budget
    notes: resilience.FaultLog
    checkpoints: Checkpoints
    first: Stage  # the decoder alone, on the cached features (SCST: on the training images)
    joint: Stage | None  # the decoder with the encoder's layers (`--fine-tune-encoder`), from `after` on


class Epoch(NamedTuple):
    """What an epoch trains with: the objective's step and where its batches come from."""

    step: TrainStep
    source: CaptionBatches | FineTuning | TrainingImages
    tuned: bool  # the encoder trains


def build(
    data: CaptionData,
    out_dir: str,
    model_cfg: DecoderConfig,
    cfg: TrainConfig,
    *,
    d: distributed.Dist,
    device: torch.device,
    init: dict | None,
    saved: dict | None,
    progress_bar: bool,
) -> tuple[Parts, Progress]:
    """The run's parts, and where it is (a resumed run's progress, with its state put back)."""
    torch.manual_seed(cfg.optim.seed)
    if cfg.optim.amp == "tf32":  # for the whole process, which is this run
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    decoder = _decoder(data, model_cfg, device, init, compile=cfg.optim.compile)
    targets = box_targets(data, cfg.terms.boxes, d) if cfg.terms.boxes else None
    groups = [{"params": list(decoder.parameters())}]
    tuning = None
    if cfg.fine_tune is not None:
        tuning = FineTuning(
            data,
            cfg.fine_tune,
            d,
            device,
            batch_size=cfg.optim.batch_size,
            targets=targets,
            progress=progress_bar and d.main,
        )
        groups.append({"params": list(tuning.parameters()), "lr": cfg.fine_tune.lr})
    optimizer = make_optimizer(groups, cfg.optim.lr, device)
    # Started after the one-off pool4 cache, which is preparation, like prepare's: not training time.
    run_log = RunLog(out_dir, main=d.main, started=time.monotonic())
    notes = resilience.FaultLog(run_log.write, show=d.main)
    live = Live(
        decoder,
        WeightAverage(decoder, cfg.optim.ema) if cfg.optim.ema else None,
        tuning,
        optimizer,
        torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", factor=0.5, patience=2),
        torch.Generator(device=device).manual_seed(cfg.optim.seed + 1 + d.rank),
        TermState(device, saved.get("terms") if saved is not None else None),
    )
    progress = restore(live, saved, out_dir, notes) if saved is not None else Progress()
    record = _record(data, out_dir, model_cfg, cfg, familiarity(data, tuning, saved, cfg.optim.seed, d.main))
    resumed = progress if saved is not None else None
    checkpoints = Checkpoints(out_dir, main=d.main, live=live, record=record, notes=notes, resumed=resumed)
    graphs = GraphCapture(device) if cfg.optim.cuda_graphs == "auto" else None
    first = stage(data, decoder, cfg, state=live.terms, targets=targets)
    joint = stage(data, decoder, cfg, state=live.terms, targets=targets, tuning=tuning) if tuning else None
    budget = Budget(cfg.schedule, started=run_log.started)
    parts = Parts(data, cfg.optim, d, device, *live, graphs, targets, run_log, budget, notes, checkpoints, first, joint)
    return parts, progress


def _decoder(data: CaptionData, model_cfg: DecoderConfig, device, init: dict | None, *, compile: bool):
    """The decoder to train: fresh, or --init's weights; its step compiled with --compile."""
    decoder = AttentionDecoder(model_cfg)
    decoder.set_feature_stats(*data.feature_stats())
    decoder = decoder.to(device)
    if init is not None:
        decoder.load_state_dict(init["model"])
    if compile:  # the average, a copy, compiles its own step
        decoder.compile_step()
    return decoder


def for_epoch(parts: Parts, progress: Progress) -> Epoch:
    """The step and batch source of the stage the current epoch is in (DDP-wrapped under torchrun)."""
    tuned = parts.joint is not None and progress.epoch >= parts.tuning.cfg.after
    objective, source = parts.joint if tuned else parts.first
    if parts.d.active:
        device_ids = [parts.device.index] if parts.device.type == "cuda" else None
        objective = DistributedDataParallel(objective, device_ids=device_ids)
    step = TrainStep(
        objective,
        parts.optimizer,
        parts.optim,
        average=parts.average,
        generator=parts.generator,
        d=parts.d,
        device=parts.device,
        steps=progress.step,
        graphs=parts.graphs,
        on_fallback=lambda message: parts.notes.warn("graph_failed", message, step=progress.step),
    )
    return Epoch(step, source, tuned)


def box_targets(data: CaptionData, path: str, d: distributed.Dist) -> BoxTargets:
    """`fit --boxes`: where the training captions' object words should look."""
    targets = BoxTargets(data, GroundingBoxes(path), data.encoder.preprocess, data.encoder.grid)
    if not targets.words:
        raise CaptionerError(
            f"--boxes {path}: no word of the training captions names an object boxed there "
            f"(the file must hold the training images of {data.dir}, by image id)"
        )
    if d.main:
        log.info(
            f"--boxes: {targets.words} words of the training captions name a boxed object; they also learn where it is"
        )
    return targets


def familiarity(data: CaptionData, tuning, saved: dict | None, seed: int, main: bool) -> dict | None:
    """The training features' statistics ("unlike the training images"), computed once per run.

    A resumed run keeps the statistics it saved (same data and seed). A fine-tuned encoder's
    features are not the cache's: its checkpoints get theirs when `fit` ends.
    """
    if tuning is not None or not main:
        return None
    if saved is not None and saved.get("familiarity") is not None:
        return saved["familiarity"]
    stats = fit_stats(data, seed=seed)
    return stats.to_dict() if stats is not None else None


def _record(data: CaptionData, out_dir: str, model_cfg: DecoderConfig, cfg: TrainConfig, familiarity) -> dict:
    """What every checkpoint of the run says of it."""
    command = ["python train.py fit --data", data.dir, "--out", out_dir, *command_line(model_cfg), *command_line(cfg)]
    return {
        "decoder": model_cfg.to_dict(),
        "train": cfg.to_dict(),
        "vocab": data.vocab.words,
        "encoder": data.encoder.to_dict(),
        "max_len": data.max_len,
        "data": {"dir": os.path.abspath(data.dir), "fingerprint": data.encoder.fingerprint},
        "familiarity": familiarity,
        "command": " ".join(command),
    }
