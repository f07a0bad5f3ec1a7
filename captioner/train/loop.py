"""`fit`: teacher-forced training on cached features, validated by generation each epoch.

One epoch reads top to bottom in this module, as in torchvision's reference scripts: `fit` settles the
settings (`train.settle`), builds the run's parts (`train.parts`: fresh, from `--init`, or resumed from
`last.pt`: `train.resume`), then for each epoch calls `train_one_epoch`, which steps through its batches
(`train.step.TrainStep`) and reads the loss back at each log line, and `validate_and_save`, which
captions the validation split (`train.selection`), chooses best.pt, writes last.pt, and steps the
learning rate's schedule; `_finish` saves what is left and ends. Checkpoints (`last.pt` every epoch,
every `checkpoint_minutes` and every `checkpoint_every` steps, `best.pt` when selected) hold everything
needed to resume exactly. Batches of an epoch are a function of (seed, epoch), so a resumed run replays
the rest of the epoch it was in. Under `torchrun` the same loop runs DistributedDataParallel: each process
takes its share of every global batch; validation is split over processes; rank 0 logs and saves.
"""

from __future__ import annotations

import logging
import math
import time

import torch
from tqdm import tqdm

from captioner import compiled
from captioner.data.dataset import CaptionData
from captioner.data.prefetch import prefetched
from captioner.errors import CaptionerError
from captioner.models.decoder import DecoderConfig
from captioner.train import distributed, resilience, telemetry
from captioner.train.budget import Budget
from captioner.train.checkpoints import Checkpoints, Live, RunLog
from captioner.train.config import Progress, TrainConfig
from captioner.train.finetune import add_tuned_familiarity
from captioner.train.parts import Stage, build, stage_at, step_compiling, train_step
from captioner.train.resume import start_from
from captioner.train.selection import chosen, select, validate
from captioner.train.settle import settle
from captioner.train.step import TrainStep

logger = logging.getLogger(__name__)


def fit(
    data_dir: str,
    out_dir: str,
    model_cfg: DecoderConfig | None = None,
    cfg: TrainConfig | None = None,
    *,
    init: str | None = None,
    boxes: str | None = None,
    resume: bool = False,
    device: str = "auto",
    progress_bar: bool = True,
    stop: resilience.GracefulStop | None = None,
    command: str | None = None,
) -> Progress:
    """Train a decoder on a prepared data directory into a run directory: last.pt, best.pt, metrics.jsonl.

    Args:
        model_cfg: decoder sizes (vocab_size is taken from the data); ignored on resume and with `init`.
        cfg: training settings (default: `TrainConfig()`); a resumed run keeps its own, but for how this
            process runs it (`train.config.per_process`); objective "scst" needs `init` or a resume.
        init: a checkpoint to start from: its weights and decoder config, with a fresh optimizer.
        boxes: object boxes of the training images (COCO instances) that teach attention (resumed: again).
        resume: continue from out_dir/last.pt (`init` is then ignored).
        device: "auto", "cpu" or "cuda" (under torchrun each process takes its local GPU).
        stop: once requested (SIGTERM, SIGINT), each process ends its step, rank 0 saves last.pt, fit returns.
        command: the command line as typed, which checkpoints record (a resumed run keeps its first one).

    Raises:
        CaptionerError: the final save of last.pt or best.pt failed (a full disk), naming the last good one.
    """
    cfg, boxed = cfg or TrainConfig(), boxes is not None
    d, dev = distributed.setup(device)
    data = CaptionData(data_dir)
    start, saved, began = start_from(data, out_dir, init, resume, dev, boxes=boxes, command=command)
    sizes = {"vocab_size": len(data.vocab), "encoder_dim": data.encoder.channels}  # the backbone row's D
    model_cfg, cfg = settle(model_cfg, cfg, **sizes, device=dev, init=start, saved=saved, views=data.views is not None,
                            boxes=boxed)  # fmt: skip
    torch.manual_seed(cfg.optim.seed)  # the process's own settings, for this run:
    if cfg.optim.amp == "tf32":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    live, stages, progress, checkpoints = build(data, out_dir, model_cfg, cfg, d=d, device=dev, init=start,
                                                saved=saved, began=began, progress_bar=progress_bar)  # fmt: skip
    budget = Budget(cfg.schedule, started=checkpoints.log.started)
    stage = stage_at(stages, progress.epoch, cfg.fine_tune)
    step = train_step(stage, live, cfg.optim, d=d, device=dev, steps=progress.step)
    checkpoints.log.write(telemetry.start_record(checkpoints.record, stage, step, progress, resume, data))
    metrics, stopped = (saved or {}).get("metrics") or {}, False
    with checkpoints.notes.recording(compiled.log):  # what compiled, and what fell back: in the log too
        while progress.epoch < cfg.schedule.epochs:
            if len(stages) > 1 and progress.epoch == cfg.fine_tune.after > 0 and progress.batch_in_epoch == 0:
                stage, step = _encoder_joins(stages, live, cfg, progress, stage, step, log=checkpoints.log)
            ended = train_one_epoch(step, stage, progress, cfg, data=data, budget=budget, checkpoints=checkpoints,
                                    metrics=metrics, stop=stop, progress_bar=progress_bar)  # fmt: skip
            if stopped := ended == "stopped":
                break
            metrics, stopped, final = validate_and_save(live, data, cfg, progress, ended, checkpoints=checkpoints,
                                                        d=d, device=dev, stop=stop, boxed=boxed)  # fmt: skip
            if final:
                break
    return _finish(live, data, cfg, progress, metrics, checkpoints, d=d, device=dev, stop=stop if stopped else None)


def validate_and_save(
    live: Live,
    data: CaptionData,
    cfg: TrainConfig,
    progress: Progress,
    ended: str | None,
    *,
    checkpoints: Checkpoints,
    d: distributed.Dist,
    device: torch.device,
    stop,
    boxed: bool,
):
    """The end of an epoch (or of the time budget): validate, step the schedule, choose best.pt, save
    best.pt and last.pt.

    Returns:
        (the validation's metrics, whether a stop was asked, whether this is the run's last epoch)
    """
    schedule, searches = cfg.schedule, step_compiling(cfg.optim, device) == compiled.GRAPHS
    try:
        metrics, hyps = validate(live, data, schedule, d=d, device=device, compiled=searches)
    except Exception:  # the epoch's steps are kept, and counted once scored: a resume validates them first
        checkpoints.save(checkpoints.last_path, progress, {}, final=True)
        raise
    if ended is None:
        progress.epoch, progress.batch_in_epoch = progress.epoch + 1, 0
    if progress.cooldown_from is None:  # the cooldown sets the rate from here on
        live.scheduler.step(metrics[schedule.metric])
    lr = float(live.optimizer.param_groups[0]["lr"])
    improved = select(progress, metrics, schedule.metric, log=checkpoints.log, d=d, lr=lr, boxed=boxed)
    checkpoints.log.examples(progress.step, data, hyps)
    # A signal during validation: last.pt is saved next, so stop there.
    stopped = distributed.any_true(d, resilience.stop_requested(stop), device)
    stale = progress.stale >= schedule.patience
    final = stopped or ended is not None or progress.epoch >= schedule.epochs or stale
    if improved:
        checkpoints.save(checkpoints.best_path, progress, metrics, final=final)
    checkpoints.save(checkpoints.last_path, progress, metrics, final=final)
    if stale:
        checkpoints.log.write({"event": "early_stop", "step": progress.step, "epoch": progress.epoch})
    return metrics, stopped, final


def _encoder_joins(
    stages: list[Stage], live: Live, cfg: TrainConfig, progress: Progress, stage: Stage, step: TrainStep, *, log: RunLog
) -> tuple[Stage, TrainStep]:
    """The decoder has trained alone for `fine_tune.after` epochs: from here the encoder trains with it."""
    if not stage.tuned:  # (a run resumed here starts with it)
        stage = stage_at(stages, progress.epoch, cfg.fine_tune)
        step = train_step(stage, live, cfg.optim, d=step.d, device=step.device, steps=progress.step)
    log.write(
        {"event": "encoder_trains", "step": progress.step, "epoch": progress.epoch, "shapes": stage.source.shapes}
    )
    if step.d.main:
        logger.info(f"epoch {progress.epoch + 1}: the encoder's layers from {cfg.fine_tune.start} train from here")
    return stage, step


def train_one_epoch(
    step: TrainStep,
    stage: Stage,
    progress: Progress,
    cfg: TrainConfig,
    *,
    data: CaptionData,
    budget: Budget,
    checkpoints: Checkpoints,
    metrics: dict,
    stop,
    progress_bar: bool,
) -> str | None:
    """The rest of the current epoch's steps (`step`'s process and device); "stopped" or "out of time" if it
    ended early. `metrics` are the last validation's, which a checkpoint saved meanwhile records."""
    d, device, optimizer = step.d, step.device, step.optimizer
    saves, pin = cfg.checkpoints, device.type == "cuda"
    bar = tqdm(
        total=stage.source.num_batches(world=d.world),
        initial=progress.batch_in_epoch,
        desc=f"epoch {progress.epoch + 1}",
        disable=not (progress_bar and d.main),
        dynamic_ncols=True,
        leave=False,
    )
    batches = stage.source.batches(
        seed=cfg.optim.seed, epoch=progress.epoch, start=progress.batch_in_epoch, rank=d.rank, world=d.world, pin=pin
    )
    waits, notes = telemetry.Waits(), checkpoints.notes
    log_terms = lambda: _log_terms(step, optimizer, progress, checkpoints, bar, waits, device)
    try:
        for batch in waits.timed(prefetched(batches)):
            # Captions of damaged feature rows were left out; a non-finite step is not applied.
            if batch.dropped:
                progress.skipped_captions += len(batch.dropped)
                notes.damaged_rows(batch.dropped, data, progress.step)
            budget.cool(optimizer, progress, d, device)
            step(batch.to(device, non_blocking=pin))
            progress.step, progress.batch_in_epoch = progress.step + 1, progress.batch_in_epoch + 1
            bar.update(1)
            # The host waits for the device here, every `log_every` steps (and at saves, and at every step of a
            # DDP run's cooldown); under DDP the processes also agree here on a save by the clock, a stop, or time.
            agree = progress.step % saves.log_every == 0
            if agree:
                log_terms()
            due = _save_due(checkpoints, saves.checkpoint_minutes, agree, d, device)
            if due or (saves.checkpoint_every and progress.step % saves.checkpoint_every == 0):
                checkpoints.save(checkpoints.last_path, progress, metrics)  # rank 0 alone writes
            for why, asked in (("stopped", resilience.stop_requested(stop)), ("out of time", budget.out())):
                if (agree or not d.active) and distributed.any_true(d, asked, device):
                    log_terms()
                    return why
        log_terms()
    finally:
        bar.close()
    return None


def _save_due(checkpoints: Checkpoints, minutes: float, agree: bool, d: distributed.Dist, device) -> bool:
    """Whether `--checkpoint-minutes` have passed since the last save. Under DDP each rank's clock is its
    own: the ranks agree on it where they agree on everything, at log lines."""
    due = bool(minutes) and time.monotonic() - checkpoints.last_save > minutes * 60
    return agree and distributed.any_true(d, due, device) if d.active else due


def _log_terms(step: TrainStep, optimizer, progress: Progress, checkpoints: Checkpoints, bar, waits, device) -> None:
    """Read the terms back from the device: a log line of their means since the last one (and of what the
    machine did: `train.telemetry`), the bar's loss, and any skipped steps."""
    terms, skipped = step.read()
    if skipped:
        progress.skipped_steps += skipped
        checkpoints.notes.skipped_steps(progress.step, skipped, terms, scaled=step.scaler.is_enabled())
    if not terms or all(math.isnan(v) for v in terms.values()):
        return
    bar.set_postfix(loss=f"{terms['loss']:.3f}")
    lr = float(optimizer.param_groups[0]["lr"])
    machine = telemetry.machine(device, waits)
    checkpoints.log.write(
        {"event": "train", "step": progress.step, "epoch": progress.epoch, "lr": lr, **machine, **terms}
    )


def _finish(
    live: Live,
    data: CaptionData,
    cfg: TrainConfig,
    progress: Progress,
    metrics: dict,
    checkpoints: Checkpoints,
    *,
    d: distributed.Dist,
    device,
    stop: resilience.GracefulStop | None,
) -> Progress:
    """Save what is left, say which best.pt was chosen and why, and end (an error if a final save failed)."""
    ft, log = cfg.fine_tune, checkpoints.log
    if stop is not None:  # a stop saves last.pt (unless it was just saved) and leaves best.pt as it is
        if checkpoints.saved(checkpoints.last_path) != progress.step:
            checkpoints.save(checkpoints.last_path, progress, metrics, final=True)
        log.write(
            {
                "event": "stopped",
                "signal": stop.signal_name,
                "step": progress.step,
                "epoch": progress.epoch,
                "saved": checkpoints.last_path not in checkpoints.failed,
            }
        )
    elif d.main and checkpoints.saved(checkpoints.best_path) is None:  # e.g. resumed after the run had finished
        checkpoints.save(checkpoints.best_path, progress, metrics, final=True)
    if live.tuning is not None and d.main and stop is None:  # a fine-tuned encoder's own statistics
        paths = [checkpoints.best_path, checkpoints.last_path]
        seconds = add_tuned_familiarity(paths, data, checkpoints, device, seed=cfg.optim.seed, workers=ft.workers)
        log.write({"event": "familiarity", "step": progress.step, "seconds": round(seconds, 2)})
    log.write(
        {
            "event": "end",
            "step": progress.step,
            "epoch": progress.epoch,
            "best": progress.best,
            "best_step": progress.best_step,
            "best_healthy": progress.best_healthy,
            "skipped_steps": progress.skipped_steps,
            "skipped_captions": progress.skipped_captions,
        }
    )
    if d.main and stop is None and progress.best_step:
        logger.info(chosen(progress, cfg.schedule.metric, boxes=checkpoints.record["data"]["boxes"] is not None))
    if d.main and stop is None and ft is not None and (progress.epoch, progress.batch_in_epoch) <= (ft.after, 0):
        logger.warning(  # not one step trained the encoder
            f"the encoder did not train: the run ended within the {ft.after} epochs the decoder trains alone "
            "first (--tune-after); `fit --resume` with more --epochs or --max-minutes goes on, "
            "or set --tune-after lower"
        )
    log.close()
    # Every rank waits for rank 0's saves and ends the same way: a failed final save is an error.
    failed, resumable = distributed.broadcast(d, (checkpoints.failed, checkpoints.last_path in checkpoints.good))
    if failed:
        message = failed.get(checkpoints.last_path) or next(iter(failed.values()))
        raise CaptionerError(message + ("; `fit --resume` continues from it" if resumable else ""))
    return progress
