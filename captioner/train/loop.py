"""`fit`: teacher-forced training on cached features, validated by generation each epoch.

The run, in the order a reader meets it: the settings are settled (`train.settle`) and the run's
parts built (`train.parts`: fresh, from `--init`, or resumed from `last.pt`: `train.resume`);
`_train_epoch` steps through an epoch's batches (`train.step.TrainStep`), reading the loss back
at each log line; `train.selection` captions the validation split and decides whether this is
the new best.pt; `_finish` saves what is left and ends. Checkpoints (`last.pt` every epoch, every
`checkpoint_minutes` and every `checkpoint_every` steps, `best.pt` when selected) hold everything
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
from captioner.train.checkpoints import Live
from captioner.train.config import Progress, ScheduleConfig, TrainConfig
from captioner.train.finetune import add_tuned_familiarity
from captioner.train.parts import Run, Stage, build, for_epoch
from captioner.train.resume import start_from
from captioner.train.selection import chosen, select, validate
from captioner.train.settle import settle
from captioner.train.step import TrainStep

log = logging.getLogger(__name__)


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
    """Train a decoder on a prepared data directory, writing last.pt, best.pt and metrics.jsonl.

    Args:
        data_dir, out_dir: the data directory `prepare` made; the run directory.
        model_cfg: decoder sizes (vocab_size is taken from the data); ignored on resume and with `init`.
        cfg: training settings (default: `TrainConfig()`); a resumed run keeps its own, but for how this
            process runs it (`train.config.per_process`); objective "scst" needs `init` or a resume.
        init: a checkpoint to start from: its weights and decoder config, with a fresh optimizer.
        boxes: the training images' object boxes (COCO instances), which teach attention where the caption
            words that name them look; a resumed run that read boxes is given them again.
        resume: continue from out_dir/last.pt (`init` is then ignored).
        device: "auto", "cpu" or "cuda" (under torchrun each process takes its local GPU).
        stop: once requested (SIGTERM, SIGINT), each process ends its step, rank 0 saves last.pt, fit returns.
        command: the command line as typed, which checkpoints record (a resumed run keeps its first one).

    Raises:
        CaptionerError: the final save of last.pt or best.pt failed (e.g. a full disk); the
            message names the last good checkpoint. Failed saves before it only warn.
    """
    cfg = cfg or TrainConfig()
    d, dev = distributed.setup(device)
    data = CaptionData(data_dir)
    start, saved, began = start_from(data, out_dir, init, resume, dev, boxes=boxes, command=command)
    sizes = {"vocab_size": len(data.vocab), "encoder_dim": data.encoder.channels}  # the backbone row's D
    views, boxed = data.views is not None, boxes is not None
    model_cfg, cfg = settle(model_cfg, cfg, **sizes, device=dev, init=start, saved=saved, views=views, boxes=boxed)
    run, live, stages, progress = build(
        data, out_dir, model_cfg, cfg, d=d, device=dev, init=start, saved=saved, origin=began, progress_bar=progress_bar
    )
    stage, step = for_epoch(run, live, stages, cfg.fine_tune, cfg.optim, progress)
    run.log.write(telemetry.start_record(run, stage, progress, resume))
    metrics, stopped = (saved or {}).get("metrics") or {}, False
    with run.notes.recording(compiled.log):  # what compiled, how long it took, and what fell back: in the log too
        while progress.epoch < cfg.schedule.epochs:
            if len(stages) > 1 and progress.epoch == cfg.fine_tune.after > 0 and progress.batch_in_epoch == 0:
                stage, step = _encoder_joins(run, live, stages, cfg, progress, stage, step)
            ended = _train_epoch(run, live.optimizer, stage, step, cfg, progress, metrics, stop, progress_bar)
            if stopped := ended == "stopped":
                break
            metrics, stopped, final = _close_epoch(run, live, cfg.schedule, progress, ended, stop, progress_bar)
            if final:
                break
    return _finish(run, live, cfg, progress, metrics, stop if stopped else None)


def _close_epoch(
    run: Run, live: Live, schedule: ScheduleConfig, progress: Progress, ended: str | None, stop, progress_bar: bool
):
    """The end of an epoch (or of the time budget): validate, select, save best.pt and last.pt.

    Returns:
        (the validation's metrics, whether a stop was asked, whether this is the run's last epoch)
    """
    try:
        metrics = validate(run, live, schedule, progress_bar)
    except Exception:  # the epoch's steps are kept, and counted once scored: a resume validates them first
        run.checkpoints.save(run.checkpoints.last_path, progress, {}, final=True)
        raise
    if ended is None:
        progress.epoch, progress.batch_in_epoch = progress.epoch + 1, 0
    improved = select(run, live, schedule.metric, progress, metrics)
    # A signal during validation: last.pt is saved next, so stop there.
    stopped = distributed.any_true(run.d, resilience.stop_requested(stop), run.device)
    stale = progress.stale >= schedule.patience
    final = stopped or ended is not None or progress.epoch >= schedule.epochs or stale
    if improved:
        run.checkpoints.save(run.checkpoints.best_path, progress, metrics, final=final)
    run.checkpoints.save(run.checkpoints.last_path, progress, metrics, final=final)
    if stale:
        run.log.write({"event": "early_stop", "step": progress.step, "epoch": progress.epoch})
    return metrics, stopped, final


def _encoder_joins(
    run: Run, live: Live, stages: list[Stage], cfg: TrainConfig, progress: Progress, stage: Stage, step: TrainStep
) -> tuple[Stage, TrainStep]:
    """The decoder has trained alone for `fine_tune.after` epochs: from here the encoder trains with it."""
    if not stage.tuned:  # (a run resumed here starts with it)
        stage, step = for_epoch(run, live, stages, cfg.fine_tune, cfg.optim, progress)
    run.log.write(
        {"event": "encoder_trains", "step": progress.step, "epoch": progress.epoch, "shapes": stage.source.shapes}
    )
    if run.d.main:
        log.info(f"epoch {progress.epoch + 1}: the encoder's layers from {cfg.fine_tune.start} train from here")
    return stage, step


def _train_epoch(
    run: Run,
    optimizer: torch.optim.Optimizer,
    stage: Stage,
    step: TrainStep,
    cfg: TrainConfig,
    progress: Progress,
    metrics: dict,
    stop,
    bar_on: bool,
) -> str | None:
    """The rest of the current epoch's steps; "stopped" or "out of time" if it ended early."""
    d, dev = run.d, run.device
    saves = cfg.checkpoints
    bar = tqdm(
        total=stage.source.num_batches(world=d.world),
        initial=progress.batch_in_epoch,
        desc=f"epoch {progress.epoch + 1}",
        disable=not (bar_on and d.main),
        dynamic_ncols=True,
        leave=False,
    )
    pin = dev.type == "cuda"
    batches = stage.source.batches(
        seed=cfg.optim.seed, epoch=progress.epoch, start=progress.batch_in_epoch, rank=d.rank, world=d.world, pin=pin
    )
    waits = telemetry.Waits()
    try:
        for batch in waits.timed(prefetched(batches)):
            # Captions of damaged feature rows were left out; a non-finite step is not applied.
            if batch.dropped:
                progress.skipped_captions += len(batch.dropped)
                run.notes.damaged_rows(batch.dropped, run.data, progress.step)
            _cool_down(run, optimizer, progress)
            step(batch.to(dev, non_blocking=pin))
            progress.step += 1
            progress.batch_in_epoch += 1
            bar.update(1)
            # The host waits for the device only here, every `log_every` steps (and at saves).
            agree = progress.step % saves.log_every == 0
            if agree:
                _log_terms(run, optimizer, step, progress, bar, waits)
            due = _save_due(run, saves.checkpoint_minutes, agree)
            if due or (saves.checkpoint_every and progress.step % saves.checkpoint_every == 0):
                run.checkpoints.save(run.checkpoints.last_path, progress, metrics)  # rank 0 alone writes
            # A stop asked of any process, or time up: all stop after this step (under DDP they agree
            # at log lines only, since agreeing reads back from the device).
            if (agree or not d.active) and distributed.any_true(d, resilience.stop_requested(stop), dev):
                _log_terms(run, optimizer, step, progress, bar, waits)
                return "stopped"
            if (agree or not d.active) and distributed.any_true(d, run.budget.out(), dev):
                _log_terms(run, optimizer, step, progress, bar, waits)
                return "out of time"
        _log_terms(run, optimizer, step, progress, bar, waits)
    finally:
        bar.close()
    return None


def _save_due(run: Run, minutes: float, agree: bool) -> bool:
    """Whether `--checkpoint-minutes` have passed since the last save. Under DDP each rank's clock is its
    own: the ranks agree on it where they agree on everything, at log lines."""
    due = bool(minutes) and time.monotonic() - run.checkpoints.last_save > minutes * 60
    return agree and distributed.any_true(run.d, due, run.device) if run.d.active else due


def _log_terms(run: Run, optimizer, step: TrainStep, progress: Progress, bar, waits: telemetry.Waits) -> None:
    """Read the terms back from the device: a log line of their means since the last one (and of what the
    machine did: `train.telemetry`), the bar's loss, and any skipped steps."""
    terms, skipped = step.read()
    if skipped:
        progress.skipped_steps += skipped
        run.notes.skipped_steps(progress.step, skipped, terms, scaled=step.scaler.is_enabled())
    if not terms or all(math.isnan(v) for v in terms.values()):
        return
    bar.set_postfix(loss=f"{terms['loss']:.3f}")
    lr = float(optimizer.param_groups[0]["lr"])
    machine = telemetry.machine(run.device, waits)
    run.log.write({"event": "train", "step": progress.step, "epoch": progress.epoch, "lr": lr, **machine, **terms})


def _cool_down(run: Run, optimizer, progress: Progress) -> None:
    """Over the last `cooldown` share of the time budget, the learning rate falls linearly to 0 from
    where it was (a warmup-stable-decay schedule without the warmup: Hägele et al., 2024, found a
    cooldown of about a fifth of training as good as cosine decay, without fixing the length of
    training in advance), so that a run still improving when its time runs out ends on weights
    that have settled."""
    if not run.budget.cools:
        return
    elapsed = distributed.all_sum(run.d, [run.budget.elapsed()], run.device)[0] / run.d.world
    left = run.budget.rate_left(elapsed)
    if left == 1.0:
        return
    groups = optimizer.param_groups
    if progress.cooldown_from is None:
        progress.cooldown_from = [float(g["lr"]) for g in groups]
    for group, lr in zip(groups, progress.cooldown_from):
        group["lr"] = lr * left  # a float: the step puts it where its graphs read it


def _finish(
    run: Run, live: Live, cfg: TrainConfig, progress: Progress, metrics: dict, stop: resilience.GracefulStop | None
) -> Progress:
    """Save what is left, say which best.pt was chosen and why, and end (an error if a final save failed)."""
    d, checkpoints = run.d, run.checkpoints
    ft = cfg.fine_tune
    if stop is not None:  # a stop saves last.pt (unless it was just saved) and leaves best.pt as it is
        if checkpoints.saved(checkpoints.last_path) != progress.step:
            checkpoints.save(checkpoints.last_path, progress, metrics, final=True)
        run.log.write(
            {
                "event": "stopped",
                "signal": stop.signal_name,
                "step": progress.step,
                "epoch": progress.epoch,
                "saved": checkpoints.last_path not in checkpoints.saver.failed,
            }
        )
    elif d.main and checkpoints.saved(checkpoints.best_path) is None:  # e.g. resumed after the run had finished
        checkpoints.save(checkpoints.best_path, progress, metrics, final=True)
    if live.tuning is not None and d.main and stop is None:
        seconds = add_tuned_familiarity(
            [checkpoints.best_path, checkpoints.last_path],
            run.data,
            checkpoints.saver,
            run.device,
            seed=cfg.optim.seed,
            workers=ft.workers,
        )
        run.log.write({"event": "familiarity", "step": progress.step, "seconds": round(seconds, 2)})
    run.log.write(
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
        log.info(chosen(progress, cfg.schedule.metric, boxes=run.boxed))
    if d.main and stop is None and ft is not None and (progress.epoch, progress.batch_in_epoch) <= (ft.after, 0):
        log.warning(  # not one step trained the encoder
            f"the encoder did not train: the run ended within the {ft.after} epochs the decoder trains alone "
            "first (--tune-after); `fit --resume` with more --epochs or --max-minutes goes on, "
            "or set --tune-after lower"
        )
    run.log.close()
    # Every rank waits for rank 0's saves and ends the same way: a failed final save is an error.
    failed, resumable = distributed.broadcast(
        d, (checkpoints.saver.failed, checkpoints.last_path in checkpoints.saver.good)
    )
    if failed:
        message = failed.get(checkpoints.last_path) or next(iter(failed.values()))
        raise CaptionerError(message + ("; `fit --resume` continues from it" if resumable else ""))
    return progress
