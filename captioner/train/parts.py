"""The parts of a training run, built once from the settled configs (`train.settle`).

`build` makes the run's `Live` objects (what a checkpoint holds: `train.checkpoints`) and its
`Stage`s, what each stretch of it trains. A run has one stage (the decoder alone on the cached
features; SCST on the training images) or, with `--fine-tune-encoder`, two: from `fine_tune.after`
on, the decoder trains with the encoder's layers on the encoder's inputs. Each stage's batches have
the shapes its source makes them in (`source.shapes`: a fine-tuned encoder's are packed), and its
objective takes them from there. `stage_at` gives the stage an epoch is in, and `train_step` the step
it trains with.
"""

from __future__ import annotations

import logging
import os
import time
from typing import NamedTuple

import torch
from torch.nn.parallel import DistributedDataParallel

from captioner.compiled import compile_mode
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
from captioner.train.config import OptimConfig, Progress, TrainConfig
from captioner.train.familiarity import fit_stats
from captioner.train.finetune import FineTuneConfig, FineTuning
from captioner.train.resume import restore
from captioner.train.step import TrainStep, make_optimizer
from captioner.train.tensorboard import open_board

log = logging.getLogger(__name__)


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
    began: dict,
    progress_bar: bool,
) -> tuple[Live, list[Stage], Progress, Checkpoints]:
    """The run's live objects, with a resumed run's state put back; its stages, in the order it trains them;
    where it is; and its checkpoints, which also keep its metrics.jsonl and its notes of faults.

    Args:
        init: `--init`'s checkpoint; saved: the resumed last.pt (each may be None).
        began: how the run began, as its checkpoints record it (`resume.start_from`).
    """
    board = open_board(cfg.checkpoints.tensorboard, main=d.main, saved=saved)  # before any slow preparation
    decoder = _decoder(data, model_cfg, device, init)
    targets = box_targets(data, began["boxes"], d) if began["boxes"] else None
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
    live = Live(
        decoder,
        WeightAverage(decoder, cfg.optim.ema) if cfg.optim.ema else None,
        tuning,
        optimizer,
        torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", factor=0.5, patience=2),
        torch.Generator(device=device).manual_seed(cfg.optim.seed + 1 + d.rank),
        TermState(device, saved.get("terms") if saved is not None else None),
    )
    stages = [stage(data, decoder, cfg, state=live.terms, targets=targets)]
    if tuning is not None:
        stages.append(stage(data, decoder, cfg, state=live.terms, targets=targets, tuning=tuning))
    # Started after the one-off pool4 cache of a fine-tuned encoder, which is preparation, like prepare's.
    log = RunLog(out_dir, main=d.main, started=time.monotonic(), board=board)
    notes = resilience.FaultLog(log.write, show=d.main)
    progress = restore(live, saved, out_dir, notes) if saved is not None else Progress()
    made = record(data, model_cfg, cfg, began, familiarity(data, tuning, saved, cfg.optim.seed, d.main))
    resumed = progress if saved is not None else None
    checkpoints = Checkpoints(out_dir, main=d.main, live=live, record=made, log=log, notes=notes, resumed=resumed)
    return live, stages, progress, checkpoints


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


def stage_at(stages: list[Stage], epoch: int, fine_tune: FineTuneConfig | None) -> Stage:
    """The stage epoch `epoch` trains in: the encoder's from `fine_tune.after` on."""
    return stages[-1] if len(stages) > 1 and epoch >= fine_tune.after else stages[0]


def train_step(
    stage: Stage, live: Live, optim: OptimConfig, *, d: distributed.Dist, device: torch.device, steps: int
) -> TrainStep:
    """The step a stage trains with (its objective DDP-wrapped under torchrun), compiled as `step_compiling` says."""
    objective = stage.objective
    if d.active:
        objective = DistributedDataParallel(objective, device_ids=[device.index] if device.type == "cuda" else None)
    return TrainStep(
        objective,
        live.optimizer,
        optim,
        average=live.average,
        generator=live.generator,
        d=d,
        device=device,
        steps=steps,
        compiled=step_compiling(optim, device),
    )


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


def record(data: CaptionData, model_cfg: DecoderConfig, cfg: TrainConfig, began: dict, familiarity) -> dict:
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
            "init": began["init"],
            "boxes": began["boxes"],
        },
        "familiarity": familiarity,
        "command": began["command"],
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
        scorer = training_scorer(data, cfg.scst.end_token)
        compiled = cfg.optim.cuda_graphs == "auto" and decoder.feature_mean.is_cuda  # a search at every step
        terms = [SelfCritical(cfg.scst, scorer, data.max_len, compiled=compiled)]
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
    objective = teacher_forced_objective(
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


def teacher_forced_objective(
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
    """The objective of a teacher-forced stage, in its batches' shapes: every term the settled configs turn on.

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
