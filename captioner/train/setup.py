"""The parts a training run is built of, from the settled configs (`train.resume.settle`).

With `--fine-tune-encoder` a run has two stages: from `fine_tune.after` on, the decoder trains with the encoder's
layers, on the encoder's inputs.
"""

from __future__ import annotations

import logging
import os
from typing import NamedTuple

import torch
from torch.nn.parallel import DistributedDataParallel

from captioner.compiled import compile_mode
from captioner.data.batches import CaptionBatches, FixedShapes, TrainingImages
from captioner.data.boxes import BoxTargets, GroundingBoxes
from captioner.data.dataset import CaptionData
from captioner.errors import CaptionerError
from captioner.evaluation.familiarity import fit_stats
from captioner.models.decoder import AttentionDecoder, DecoderConfig
from captioner.objectives.objective import Objective, objective_terms
from captioner.objectives.scst import SelfCritical, training_scorer
from captioner.objectives.terms import TermState
from captioner.train import distributed
from captioner.train.checkpoints import Live
from captioner.train.config import OptimConfig, ProcessConfig, TrainConfig
from captioner.train.finetune import FineTuneConfig, FineTuning
from captioner.train.step import TrainStep
from captioner.train.word_maps import word_map_targets

log = logging.getLogger(__name__)


class Stage(NamedTuple):
    """What a stretch of the run trains: its objective, where its batches come from, whether the encoder trains."""

    objective: Objective
    source: CaptionBatches | FineTuning | TrainingImages
    tuned: bool


def make_decoder(data: CaptionData, model_cfg: DecoderConfig, device, init: dict | None) -> AttentionDecoder:
    """The decoder to train: fresh, or --init's weights."""
    decoder = AttentionDecoder(model_cfg)
    decoder.set_feature_stats(*data.feature_stats())
    decoder = decoder.to(device)
    if init is not None:
        decoder.load_state_dict(init["model"])
    return decoder


def step_compiling(process: ProcessConfig, device: torch.device) -> str | None:
    """The compiler's mode for the run's steps: on a GPU with `--cuda-graphs auto`, "reduce-overhead" (and the
    searches compile too); elsewhere "default" with `--compile`; None: eager steps."""
    if device.type == "cuda" and process.cuda_graphs == "auto" or process.compile:
        return compile_mode(device, graphs=process.cuda_graphs == "auto")
    return None


def stage_at(stages: list[Stage], epoch: int, fine_tune: FineTuneConfig | None) -> Stage:
    """The stage epoch `epoch` trains in: the encoder's from `fine_tune.after` on."""
    return stages[-1] if len(stages) > 1 and epoch >= fine_tune.after else stages[0]


def train_step(stage: Stage, live: Live, optim: OptimConfig, process: distributed.Process, steps: int) -> TrainStep:
    """The step a stage trains with (its objective DDP-wrapped under torchrun), `steps` optimizer steps in."""
    objective, device = stage.objective, process.device
    if process.dist.active:
        objective = DistributedDataParallel(objective, device_ids=[device.index] if device.type == "cuda" else None)
    return TrainStep(objective, live, optim, process, steps=steps)


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


def attention_targets(data: CaptionData, boxes: str | None, cfg: TrainConfig, d: distributed.Dist) -> BoxTargets | None:
    """Where the training captions' words should look: the objects `--boxes` boxes, or the word maps' peaks."""
    if cfg.terms.word_maps:
        return word_map_targets(data, seed=cfg.optim.seed, main=d.main)
    return box_targets(data, boxes, d) if boxes else None


def familiarity(data: CaptionData, tuning, saved: dict | None, seed: int, main: bool) -> dict | None:
    """The training features' statistics, once per run; a resumed run keeps its saved ones. A fine-tuned encoder's
    checkpoints get theirs when `fit` ends (its features are not the cache's)."""
    if tuning is not None or not main:
        return None
    if saved is not None and saved.get("familiarity") is not None:
        return saved["familiarity"]
    stats = fit_stats(data, seed=seed)
    return stats.to_dict() if stats is not None else None


def record(data: CaptionData, model_cfg: DecoderConfig, cfg: TrainConfig, began: dict, familiarity) -> dict:
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
        compiled = cfg.process.cuda_graphs == "auto" and decoder.feature_mean.is_cuda  # a search at every step
        terms = [SelfCritical(cfg.scst, scorer, data.max_len, compiled=compiled)]
        return Stage(Objective(decoder, terms), TrainingImages(data, cfg.optim.batch_size), tuned=False)
    # `settle` set the consistency to 0 where neither the prepared views nor an encoder's own will be
    views = cfg.terms.consistency > 0 and (tuning is not None or data.views is not None)
    share = cfg.terms.consistency_share if views else 0.0
    fixed = None
    if tuning is None and cfg.process.shapes == "fixed":
        fixed = FixedShapes.for_data(cfg.optim.batch_size, int(data.lengths.max()))
    source = tuning
    if tuning is None:
        source = CaptionBatches(data, cfg.optim.batch_size, view_share=share, targets=targets, fixed=fixed)
    encoder = tuning.encoder if tuning is not None else None
    objective = teacher_forced_objective(decoder, cfg, views=views, state=state, targets=targets, encoder=encoder)
    return Stage(objective, source, tuned=tuning is not None)


def teacher_forced_objective(
    decoder: AttentionDecoder,
    cfg: TrainConfig,
    *,
    views: bool,
    state: TermState,
    targets: BoxTargets | None = None,
    encoder=None,
) -> Objective:
    """The objective of a teacher-forced stage: every term the settled configs turn on, in its batches' shapes
    (a fine-tuned `encoder`'s are packed). `views`: the consistency has views (prepared, or the encoder's own,
    which it makes for its share of the captions); `state`: the run's terms' state."""
    attention, hard = decoder.config.attention, cfg.hard
    terms = objective_terms(cfg.terms, attention=attention, hard=hard, views=views, state=state, targets=targets)
    return Objective(
        decoder,
        terms,
        shapes=FineTuning.shapes if encoder is not None else cfg.process.shapes,
        semi_sampling=hard.semi_sampling if attention == "hard" else None,
        encoder=encoder,
        view_share=cfg.terms.consistency_share if views else 0.0,
    )
