"""The parts of a training run, built once from the settled configs (`train.settle`).

`build` makes three named things, putting a resumed run's state back into them: the `Run` (where it
reads, runs and writes), its `Live` objects (what a checkpoint holds: `train.checkpoints`) and its
`Stage`s, what each stretch of it trains. A run has one stage (the decoder alone on the cached
features; SCST on the training images) or, with `--fine-tune-encoder`, two: from `fine_tune.after`
on, the decoder trains with the encoder's layers on the encoder's inputs. Each stage's batches have
the shapes its source makes them in (`source.shapes`: a fine-tuned encoder's are packed), and its
objective takes them from there. `for_epoch` gives the stage an epoch is in and the step it trains with.
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import NamedTuple

import torch
from torch.nn.parallel import DistributedDataParallel

from captioner.compiled import GRAPHS, compile_mode
from captioner.data.batches import CaptionBatches, FixedShapes, TrainingImages
from captioner.data.boxes import BoxTargets, GroundingBoxes
from captioner.data.dataset import CaptionData
from captioner.errors import CaptionerError
from captioner.models.decoder import AttentionDecoder, DecoderConfig
from captioner.objectives.objective import Objective, objective_terms
from captioner.objectives.passes import Shapes
from captioner.objectives.reinforce import HardAttentionConfig
from captioner.objectives.scst import SelfCritical, training_scorer
from captioner.objectives.terms import TermsConfig, TermState
from captioner.train import distributed, resilience
from captioner.train.averaging import WeightAverage
from captioner.train.checkpoints import Checkpoints, Live, RunLog
from captioner.train.config import OptimConfig, Progress, ScheduleConfig, TrainConfig
from captioner.train.familiarity import fit_stats
from captioner.train.finetune import FineTuneConfig, FineTuning
from captioner.train.resume import restore
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


class Run(NamedTuple):
    """Where a run reads, runs and writes."""

    data: CaptionData
    d: distributed.Dist
    device: torch.device
    compiled: str | None  # the compiler's mode for the steps (`step_compiling`), None: eager
    log: RunLog
    notes: resilience.FaultLog  # what went wrong and was survived, in the log
    checkpoints: Checkpoints
    budget: Budget

    @property
    def compiled_search(self) -> bool:
        """The searches (validation, SCST's greedy baseline) compile, and replay as CUDA graphs."""
        return self.compiled == GRAPHS

    @property
    def boxed(self) -> bool:
        """The run reads object boxes (`fit --boxes`), as its checkpoints record."""
        return self.checkpoints.record["data"]["boxes"] is not None


class Stage(NamedTuple):
    """What a stretch of the run trains: its objective, where its batches come from, whether the encoder trains."""

    objective: Objective
    source: CaptionBatches | FineTuning | TrainingImages
    tuned: bool


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
    origin: dict,
    progress_bar: bool,
) -> tuple[Run, Live, list[Stage], Progress]:
    """The run, its live objects, its stages (in the order it trains them), and where it is (its progress).

    Args:
        origin: how the run began, as its checkpoints record it (`resume.start_from`).
    """
    torch.manual_seed(cfg.optim.seed)
    if cfg.optim.amp == "tf32":  # for the whole process, which is this run
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    decoder = _decoder(data, model_cfg, device, init)
    targets = box_targets(data, origin["boxes"], d) if origin["boxes"] else None
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
    record = _record(data, model_cfg, cfg, origin, familiarity(data, tuning, saved, cfg.optim.seed, d.main))
    resumed = progress if saved is not None else None
    checkpoints = Checkpoints(out_dir, main=d.main, live=live, record=record, notes=notes, resumed=resumed)
    stages = [stage(data, decoder, cfg, state=live.terms, targets=targets)]
    if tuning is not None:
        stages.append(stage(data, decoder, cfg, state=live.terms, targets=targets, tuning=tuning))
    compiled = step_compiling(cfg.optim, device)
    run = Run(data, d, device, compiled, run_log, notes, checkpoints, Budget(cfg.schedule, started=run_log.started))
    return run, live, stages, progress


def _decoder(data: CaptionData, model_cfg: DecoderConfig, device, init: dict | None):
    """The decoder to train: fresh, or --init's weights."""
    decoder = AttentionDecoder(model_cfg)
    decoder.set_feature_stats(*data.feature_stats())
    decoder = decoder.to(device)
    if init is not None:
        decoder.load_state_dict(init["model"])
    return decoder


def step_compiling(optim: OptimConfig, device: torch.device) -> str | None:
    """The compiler's mode for the run's steps: on a GPU with `--cuda-graphs auto`, "reduce-overhead" (and the
    searches compile too); elsewhere "default" with `--compile`; None: eager steps."""
    if device.type == "cuda" and optim.cuda_graphs == "auto" or optim.compile:
        return compile_mode(device, graphs=optim.cuda_graphs == "auto")
    return None


def for_epoch(
    run: Run, live: Live, stages: list[Stage], fine_tune: FineTuneConfig | None, optim: OptimConfig, progress: Progress
) -> tuple[Stage, TrainStep]:
    """The stage the current epoch is in, and the step it trains with (DDP-wrapped under torchrun)."""
    tuned = len(stages) > 1 and progress.epoch >= fine_tune.after
    current = stages[-1] if tuned else stages[0]
    objective = current.objective
    if run.d.active:
        device_ids = [run.device.index] if run.device.type == "cuda" else None
        objective = DistributedDataParallel(objective, device_ids=device_ids)
    step = TrainStep(
        objective,
        live.optimizer,
        optim,
        average=live.average,
        generator=live.generator,
        d=run.d,
        device=run.device,
        steps=progress.step,
        compiled=run.compiled,
    )
    return current, step


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


def _record(data: CaptionData, model_cfg: DecoderConfig, cfg: TrainConfig, origin: dict, familiarity) -> dict:
    """What every checkpoint of the run says of it."""
    return {
        "decoder": model_cfg.to_dict(),
        "train": cfg.to_dict(),
        "vocab": data.vocab.words,
        "encoder": data.encoder.to_dict(),
        "max_len": data.max_len,
        "data": {
            "dir": os.path.abspath(data.dir),
            "fingerprint": data.encoder.fingerprint,
            "init": origin["init"],
            "boxes": origin["boxes"],
        },
        "familiarity": familiarity,
        "command": origin["command"],
    }


def stage(
    data: CaptionData,
    decoder: AttentionDecoder,
    cfg: TrainConfig,
    *,
    state: TermState,
    targets: BoxTargets | None,
    tuning: FineTuning | None = None,
) -> Stage:
    """The objective of the settled configs and its batch source: on the cached features, or on a
    fine-tuned encoder's inputs (which also makes the views of the consistency's share of captions)."""
    if cfg.objective == "scst":
        scorer, compiled = training_scorer(data, cfg.scst.end_token), cfg.optim.cuda_graphs == "auto"
        terms = [SelfCritical(cfg.scst, scorer, data.max_len, compiled=None if compiled else False)]
        return Stage(Objective(decoder, terms), TrainingImages(data, cfg.optim.batch_size), tuned=False)
    # `settle` set the consistency to 0 where neither the prepared views nor an encoder's own will be
    views = cfg.terms.consistency > 0 and (tuning is not None or data.views is not None)
    share = cfg.terms.consistency_share if views else 0.0
    fixed = None
    if tuning is None and cfg.optim.shapes == "fixed":
        fixed = FixedShapes.for_data(cfg.optim.batch_size, int(data.lengths.max()))
    source = tuning
    if tuning is None:
        source = CaptionBatches(data, cfg.optim.batch_size, view_share=share, targets=targets, fixed=fixed)
    objective = cross_entropy_objective(
        decoder,
        cfg.terms,
        cfg.hard,
        shapes=source.shapes,
        views=views,
        state=state,
        targets=targets,
        encoder=tuning.encoder if tuning is not None else None,
        view_share=share,
    )
    return Stage(objective, source, tuned=tuning is not None)


def cross_entropy_objective(
    decoder: AttentionDecoder,
    terms_cfg: TermsConfig,
    hard: HardAttentionConfig,
    *,
    shapes: Shapes,
    views: bool,
    state: TermState,
    targets: BoxTargets | None = None,
    encoder=None,
    view_share: float = 0.0,
) -> Objective:
    """The cross-entropy objective of settled term configs, in its batches' shapes.

    Args:
        views: the consistency has views (prepared, or the encoder's own).
        state: the run's terms' state.
        encoder: a fine-tuned encoder, which makes the views of `view_share` of the captions.
    """
    attention = decoder.config.attention
    terms = objective_terms(terms_cfg, attention=attention, hard=hard, views=views, state=state, targets=targets)
    return Objective(
        decoder,
        terms,
        shapes=shapes,
        semi_sampling=hard.semi_sampling if attention == "hard" else None,
        encoder=encoder,
        view_share=view_share,
    )
