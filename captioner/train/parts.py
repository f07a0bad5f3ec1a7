"""The parts of a training run, built once from the settled configs (`train.settle`).

`checked_checkpoint` reads the checkpoint of `--init` or `--resume` and refuses one made on
other data; `build` makes the long-lived parts (decoder, its average, a fine-tuned encoder,
optimizer, schedule, random stream, log, checkpoints), restoring a resumed run's state into
them; `for_epoch` makes the objective, its step and its batch source for an epoch (until the
encoder trains, the decoder's alone, on the cached features).
"""

from __future__ import annotations

import logging
import os
import time
from typing import NamedTuple

import torch
from torch.nn.parallel import DistributedDataParallel

from captioner.data.batches import CaptionBatches, FixedShapes, TrainingImages
from captioner.data.boxes import BoxTargets, GroundingBoxes
from captioner.data.dataset import CaptionData
from captioner.errors import CaptionerError
from captioner.models.checkpoint import load_checkpoint
from captioner.models.cuda_graphs import GraphCapture
from captioner.models.decoder import AttentionDecoder, DecoderConfig
from captioner.models.encoder import EncoderSpec
from captioner.objectives.objective import Objective, objective_terms
from captioner.objectives.scst import SelfCritical, training_scorer
from captioner.objectives.terms import TermState
from captioner.options import command_line
from captioner.train import distributed, resilience
from captioner.train.averaging import WeightAverage
from captioner.train.checkpoints import Checkpoints, Live, RunLog
from captioner.train.config import Progress, TrainConfig
from captioner.train.familiarity import fit_stats
from captioner.train.finetune import FineTuning
from captioner.train.step import TrainStep, make_optimizer

log = logging.getLogger(__name__)


class Parts(NamedTuple):
    """What a run keeps from start to end."""

    data: CaptionData
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
    notes: resilience.FaultLog
    checkpoints: Checkpoints


class Epoch(NamedTuple):
    """What an epoch trains with: the objective's step and where its batches come from."""

    step: TrainStep
    source: CaptionBatches | FineTuning | TrainingImages
    tuned: bool  # the encoder trains


def checked_checkpoint(path: str, data: CaptionData, device: torch.device, flag: str) -> dict:
    """The checkpoint of --init or --resume, refused unless it was trained on this data's vocabulary and encoder."""
    try:
        ck = load_checkpoint(path, map_location=device)
    except CaptionerError as e:
        raise CaptionerError(f"{flag}: {e}") from None
    if ck["vocab"] != data.vocab.words:
        raise CaptionerError(
            f"{flag}: {path} has a vocabulary of {len(ck['vocab'])} words that differs from {data.dir}'s "
            f"({len(data.vocab)} words); start from a model trained on this data"
        )
    fingerprint = (ck.get("data") or {}).get("fingerprint") or EncoderSpec.from_dict(ck["encoder"]).fingerprint
    if fingerprint != data.encoder.fingerprint:
        raise CaptionerError(
            f"{flag}: {path} was trained on features of encoder {fingerprint}, but {data.dir} holds features "
            f"of encoder {data.encoder.fingerprint}"
        )
    return ck


def check_resume(ck: dict, cfg: TrainConfig, path: str) -> None:
    """Refuse to resume with options that contradict the saved run."""
    saved = TrainConfig.from_dict(ck["train"])
    if cfg.objective == "scst" and saved.objective != "scst":
        raise CaptionerError(
            f"--resume --objective scst: {path} is a cross-entropy run; start self-critical training from it "
            f"with --init {os.path.join(os.path.dirname(path), 'best.pt')} and a new --out"
        )
    # Encoder fine-tuning: the layers and their learning rate are the saved ones; workers may change.
    mine, theirs = cfg.fine_tune, saved.fine_tune
    if mine is not None and (theirs is None or (mine.start, mine.lr) != (theirs.start, theirs.lr)):
        raise CaptionerError(
            f"--resume: {path} was trained {'with other' if theirs else 'without'} --fine-tune-encoder settings; "
            "resume without those flags to continue as it was"
        )
    if theirs is not None and "encoder_state" not in ck:
        raise CaptionerError(f"--resume: {path} lacks the encoder_state its fine-tuning settings call for")


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
    decoder = AttentionDecoder.from_config(model_cfg)
    decoder.set_feature_stats(*data.feature_stats())
    decoder = decoder.to(device)
    if init is not None:
        decoder.load_state_dict(init["model"])
    if cfg.optim.compile:  # the average, a copy, compiles its own step
        decoder.compile_step()
    groups = [{"params": list(decoder.parameters())}]
    targets = box_targets(data, cfg.terms.boxes, d) if cfg.terms.boxes else None
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
    started = time.monotonic()  # the one-off pool4 cache is preparation, like prepare's: not training time
    run_log = RunLog(out_dir, main=d.main, started=started)
    notes = resilience.FaultLog(run_log.write, show=d.main)
    parts = Parts(
        data,
        d,
        device,
        decoder,
        WeightAverage(decoder, cfg.optim.ema) if cfg.optim.ema else None,
        tuning,
        optimizer,
        torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", factor=0.5, patience=2),
        torch.Generator(device=device).manual_seed(cfg.optim.seed + 1 + d.rank),
        TermState(device, saved.get("terms") if saved is not None else None),
        GraphCapture(device) if cfg.optim.cuda_graphs == "auto" else None,
        targets,
        run_log,
        notes,
        None,
    )
    progress = _restore(parts, saved, out_dir) if saved is not None else Progress()
    record = _record(data, out_dir, model_cfg, cfg, familiarity(data, tuning, saved, cfg.optim.seed, d.main))
    live = Live(parts.decoder, parts.average, parts.tuning, optimizer, parts.scheduler, parts.generator, parts.terms)
    checkpoints = Checkpoints(
        out_dir,
        main=d.main,
        live=live,
        record=record,
        notes=notes,
        resumed=progress if saved is not None else None,
    )
    return parts._replace(checkpoints=checkpoints), progress


def for_epoch(parts: Parts, model_cfg: DecoderConfig, cfg: TrainConfig, progress: Progress) -> Epoch:
    """The objective's step and batch source for the current epoch (DDP-wrapped under torchrun)."""
    data, d, device = parts.data, parts.d, parts.device
    tuned = parts.tuning is not None and progress.epoch >= cfg.fine_tune.after
    if cfg.objective == "scst":
        terms = [SelfCritical(cfg.scst, training_scorer(data, cfg.scst.end_token), data.max_len)]
        objective, source = Objective(parts.decoder, terms), TrainingImages(data, cfg.optim.batch_size)
    else:
        views = _views(data, cfg, d, tuned)
        objective = cross_entropy_objective(
            parts.decoder,
            cfg,
            views=views,
            state=parts.terms,
            targets=parts.targets,
            encoder=parts.tuning.encoder if tuned else None,
        )
        source = parts.tuning if tuned else _caption_batches(data, cfg, parts.targets, view_share(cfg, views))
    if d.active:
        objective = DistributedDataParallel(objective, device_ids=[device.index] if device.type == "cuda" else None)
    step = TrainStep(
        objective,
        parts.optimizer,
        cfg.optim,
        average=parts.average,
        generator=parts.generator,
        d=d,
        device=device,
        steps=progress.step,
        graphs=parts.graphs,
        on_fallback=lambda message: parts.notes.warn("graph_failed", message, step=progress.step),
    )
    return Epoch(step, source, tuned)


def cross_entropy_objective(
    decoder: AttentionDecoder,
    cfg: TrainConfig,
    *,
    views: bool,
    state: TermState,
    targets: BoxTargets | None = None,
    encoder=None,
) -> Objective:
    """The cross-entropy objective of settled configs: its terms, in the run's shapes (a fine-tuned
    `encoder`'s batches are packed, and it makes the views of the consistency's share of captions).

    Args:
        views: the consistency has views (prepared, or the encoder's own).
        state: the run's terms' state.
    """
    attention = decoder.config.attention
    terms = objective_terms(cfg.terms, attention=attention, hard=cfg.hard, views=views, state=state, targets=targets)
    return Objective(
        decoder,
        terms,
        shapes="packed" if encoder is not None else cfg.optim.shapes,
        semi_sampling=cfg.hard.semi_sampling if attention == "hard" else None,
        encoder=encoder,
        view_share=view_share(cfg, views) if encoder is not None else 0.0,
    )


def view_share(cfg: TrainConfig, views: bool) -> float:
    """The share of each batch's captions the consistency is estimated on (0: no consistency)."""
    return cfg.terms.consistency_share if views and cfg.terms.consistency > 0 else 0.0


def _caption_batches(data: CaptionData, cfg: TrainConfig, targets, share: float) -> CaptionBatches:
    fixed = None
    if cfg.optim.shapes == "fixed":
        fixed = FixedShapes.for_data(cfg.optim.batch_size, int(data.lengths.max()))
    return CaptionBatches(data, cfg.optim.batch_size, view_share=share, targets=targets, fixed=fixed)


def _views(data: CaptionData, cfg: TrainConfig, d: distributed.Dist, tuned: bool) -> bool:
    """Whether the consistency has views: the prepared ones, or a fine-tuned encoder's own (`settle` set
    the consistency to 0 where neither will be)."""
    return cfg.terms.consistency > 0 and (tuned or data.views is not None)


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


def _restore(parts: Parts, ck: dict, out_dir: str) -> Progress:
    """Put a resumed run's saved state back: weights, optimizer, schedule, random streams; its progress."""
    parts.decoder.load_state_dict(ck.get("training_model", ck["model"]))
    if parts.average:
        parts.average.load_state_dict(ck["model"])
    if parts.tuning is not None:
        parts.tuning.encoder.load_encoder_state(ck["encoder_state"], os.path.join(out_dir, "last.pt"))
    parts.optimizer.load_state_dict(ck["optimizer"])
    parts.scheduler.load_state_dict(ck["scheduler"])
    progress = Progress(**ck["progress"])
    if progress.cooldown_from is not None:  # this invocation has its own budget, and its own cooldown
        for group, lr in zip(parts.optimizer.param_groups, progress.cooldown_from):
            group["lr"] = lr
        progress.cooldown_from = None
    _restore_streams(parts, ck["rng"], progress.step)
    return progress


def _restore_streams(parts: Parts, rng: dict, step: int) -> None:
    """The random streams of a resumed run: as saved where they fit this device and GPU count; where
    they do not (a run saved on a GPU resumed on a CPU, or on fewer GPUs), reseeded from the step,
    with a note in the log."""
    torch.set_rng_state(rng["torch"].cpu())
    reseeded = []
    state = rng["generator"].cpu()
    if state.numel() == parts.generator.get_state().numel():
        parts.generator.set_state(state)
    else:
        parts.generator.manual_seed(int(parts.generator.initial_seed()) + step)
        reseeded.append(f"the terms' generator (saved on another kind of device, now {parts.device.type})")
    saved_cuda, here = rng["cuda"], torch.cuda.device_count() if torch.cuda.is_available() else 0
    for i, s in enumerate(saved_cuda[:here]):
        torch.cuda.set_rng_state(s.cpu(), i)
    for i in range(len(saved_cuda), here):
        with torch.cuda.device(i):
            torch.cuda.manual_seed(torch.initial_seed() + step)
    if len(saved_cuda) != here:
        reseeded.append(f"the CUDA streams ({len(saved_cuda)} saved, {here} GPUs here)")
    if reseeded:
        parts.notes.warn(
            "rng_reseeded",
            f"--resume: reseeded {' and '.join(reseeded)}: the run goes on, but not with the draws it would have had",
            step=step,
        )


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
