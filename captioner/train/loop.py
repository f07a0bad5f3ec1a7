"""`fit`: teacher-forced training on cached features, validated by generation each epoch.

The run, in the order a reader meets it: the settings are settled (`train.settle`) and the parts
built (`train.parts`: fresh, from `--init`, or resumed from `last.pt`: `train.resume`);
`_train_epoch` steps through an epoch's batches (`train.step.TrainStep`), reading the loss back
at each log line; `train.selection` captions the validation split and decides whether this is
the new best.pt; `_finish` saves what is left and ends. Checkpoints (`last.pt` every epoch, every
`checkpoint_minutes` and every `checkpoint_every` steps, `best.pt` when selected) hold everything
needed to resume exactly. Batches of an epoch are a function of (seed, epoch), so a resumed run
replays the rest of the epoch it was in. Under `torchrun` the same loop runs
DistributedDataParallel: each process takes its share of every global batch; validation is split
over processes and gathered; rank 0 logs and saves.
"""

from __future__ import annotations

import logging
import math
import time

from tqdm import tqdm

from captioner.cuda_graphs import CaptureBroken
from captioner.data.dataset import CaptionData
from captioner.data.prefetch import prefetched
from captioner.decoding import graphed_search
from captioner.errors import CaptionerError
from captioner.models.decoder import DecoderConfig
from captioner.train import distributed, resilience, telemetry
from captioner.train.config import CheckpointConfig, Progress, ScheduleConfig, TrainConfig
from captioner.train.finetune import add_tuned_familiarity
from captioner.train.parts import Epoch, Parts, build, for_epoch
from captioner.train.resume import start_from
from captioner.train.selection import chosen, select, validate
from captioner.train.settle import settle

log = logging.getLogger(__name__)


def fit(
    data_dir: str,
    out_dir: str,
    model_cfg: DecoderConfig | None = None,
    cfg: TrainConfig | None = None,
    *,
    resume: bool = False,
    device: str = "auto",
    progress_bar: bool = True,
    stop: resilience.GracefulStop | None = None,
) -> Progress:
    """Train a decoder on a prepared data directory, writing last.pt, best.pt and metrics.jsonl.

    Args:
        data_dir: made by `prepare`.
        out_dir: the run directory.
        model_cfg: decoder sizes (vocab_size is taken from the data); ignored on resume and with cfg.init.
        cfg: training settings (default: `TrainConfig()`); on resume the saved ones are used, except
            how this process runs the run: how far, graphs, compile, shapes, workers, saving and logging
            (`train.config.per_process`). With cfg.init, training
            starts from that checkpoint's weights and decoder config (a fresh optimizer); cfg.objective
            "scst" needs cfg.init or a resume.
        resume: continue from out_dir/last.pt (cfg.init is then ignored).
        device: "auto", "cpu" or "cuda" (under torchrun each process takes its local GPU).
        stop: once it is requested (SIGTERM, SIGINT), every process finishes its step, rank 0
            saves last.pt, and fit returns; `resume` continues from there exactly.

    Raises:
        CaptionerError: the final save of last.pt or best.pt failed (e.g. a full disk); the
            message names the last good checkpoint. Failed saves before it only warn.
    """
    cfg = cfg or TrainConfig()
    d, dev = distributed.setup(device)
    data = CaptionData(data_dir)
    init, saved = start_from(data, out_dir, cfg.init, resume, dev)
    views = data.views is not None
    sizes = {"vocab_size": len(data.vocab), "encoder_dim": data.encoder.channels}  # the backbone row's D
    model_cfg, cfg = settle(model_cfg, cfg, **sizes, device=dev, init=init, saved=saved, views=views)
    parts, progress = build(
        data, out_dir, model_cfg, cfg, d=d, device=dev, init=init, saved=saved, progress_bar=progress_bar
    )
    epoch = for_epoch(parts, progress)
    parts.log.write(telemetry.start_record(parts, epoch, progress, resume))
    metrics, stopped = (saved or {}).get("metrics") or {}, False
    try:
        with parts.notes.recording(graphed_search.log, "graph_failed"):  # the searches' fallbacks, in the log too
            while progress.epoch < cfg.schedule.epochs:
                if parts.joint and progress.epoch == parts.tuning.cfg.after > 0 and progress.batch_in_epoch == 0:
                    epoch = _encoder_joins(parts, epoch, progress)
                ended = _train_epoch(parts, epoch, cfg.checkpoints, progress, metrics, stop, progress_bar)
                if ended == "stopped":
                    stopped = True
                    break
                metrics, stopped, final = _close_epoch(parts, cfg.schedule, progress, ended, stop, progress_bar)
                if final:
                    break
    except CaptureBroken as e:  # CUDA may be left mid-capture: save, and end with the way on
        resilience.end_broken(parts.checkpoints, parts.log, progress, metrics, e)
    return _finish(parts, cfg.schedule, progress, metrics, stop if stopped else None)


def _close_epoch(
    parts: Parts, schedule: ScheduleConfig, progress: Progress, ended: str | None, stop, progress_bar: bool
):
    """The end of an epoch (or of the time budget): validate, select, save best.pt and last.pt.

    Returns:
        (the validation's metrics, whether a stop was asked, whether this is the run's last epoch)
    """
    if ended is None:
        progress.epoch += 1
        progress.batch_in_epoch = 0
    metrics = validate(parts, schedule, progress_bar)
    improved = select(parts, schedule.metric, progress, metrics)
    # A signal during validation: last.pt is saved next, so stop there.
    stopped = distributed.any_true(parts.d, resilience.stop_requested(stop), parts.device)
    stale = progress.stale >= schedule.patience
    final = stopped or ended is not None or progress.epoch >= schedule.epochs or stale
    if improved:
        parts.checkpoints.save(parts.checkpoints.best_path, progress, metrics, final=final)
    parts.checkpoints.save(parts.checkpoints.last_path, progress, metrics, final=final)
    if stale:
        parts.log.write({"event": "early_stop", "step": progress.step, "epoch": progress.epoch})
    return metrics, stopped, final


def _encoder_joins(parts: Parts, epoch: Epoch, progress: Progress) -> Epoch:
    """The decoder has trained alone for `fine_tune.after` epochs: from here the encoder trains with it."""
    if not epoch.tuned:  # (a run resumed here starts with it)
        epoch = for_epoch(parts, progress)
    parts.log.write(
        {"event": "encoder_trains", "step": progress.step, "epoch": progress.epoch, "shapes": epoch.source.shapes}
    )
    if parts.d.main:
        log.info(f"epoch {progress.epoch + 1}: the encoder's layers from {parts.tuning.cfg.start} train from here")
    return epoch


def _train_epoch(
    parts: Parts,
    epoch: Epoch,
    saves: CheckpointConfig,
    progress: Progress,
    metrics: dict,
    stop,
    bar_on: bool,
) -> str | None:
    """The rest of the current epoch's steps; "stopped" or "out of time" if it ended early."""
    d, dev = parts.d, parts.device
    bar = tqdm(
        total=epoch.source.num_batches(world=d.world),
        initial=progress.batch_in_epoch,
        desc=f"epoch {progress.epoch + 1}",
        disable=not (bar_on and d.main),
        dynamic_ncols=True,
        leave=False,
    )
    pin = dev.type == "cuda"
    batches = epoch.source.batches(
        seed=parts.optim.seed, epoch=progress.epoch, start=progress.batch_in_epoch, rank=d.rank, world=d.world, pin=pin
    )
    waits = telemetry.Waits()
    try:
        for batch in waits.timed(prefetched(batches)):
            # Captions of damaged feature rows were left out; a non-finite step is not applied.
            if batch.dropped:
                progress.skipped_captions += len(batch.dropped)
                parts.notes.damaged_rows(batch.dropped, parts.data, progress.step)
            _cool_down(parts, progress)
            epoch.step(batch.to(dev, non_blocking=pin))
            progress.step += 1
            progress.batch_in_epoch += 1
            bar.update(1)
            # The host waits for the device only here, every `log_every` steps (and at saves).
            agree = progress.step % saves.log_every == 0
            if agree:
                _log_terms(parts, epoch, progress, bar, waits)
            due = saves.checkpoint_minutes and (
                time.monotonic() - parts.checkpoints.last_save > saves.checkpoint_minutes * 60
            )
            if due or (saves.checkpoint_every and progress.step % saves.checkpoint_every == 0):
                parts.checkpoints.save(parts.checkpoints.last_path, progress, metrics)  # rank 0 alone writes
            # A stop asked of any process, or time up: all stop after this step (under DDP they agree
            # at log lines only, since agreeing reads back from the device).
            if (agree or not d.active) and distributed.any_true(d, resilience.stop_requested(stop), dev):
                _log_terms(parts, epoch, progress, bar, waits)
                return "stopped"
            if (agree or not d.active) and distributed.any_true(d, parts.budget.out(), dev):
                _log_terms(parts, epoch, progress, bar, waits)
                return "out of time"
        _log_terms(parts, epoch, progress, bar, waits)
    finally:
        bar.close()
    return None


def _log_terms(parts: Parts, epoch: Epoch, progress: Progress, bar, waits: telemetry.Waits) -> None:
    """Read the terms back from the device: a log line of their means since the last one (and of what the
    machine did: `train.telemetry`), the bar's loss, and any skipped steps."""
    terms, skipped = epoch.step.read()
    if skipped:
        progress.skipped_steps += skipped
        parts.notes.skipped_steps(progress.step, skipped, terms, scaled=epoch.step.scaler.is_enabled())
    if not terms or all(math.isnan(v) for v in terms.values()):
        return
    bar.set_postfix(loss=f"{terms['loss']:.3f}")
    lr = float(parts.optimizer.param_groups[0]["lr"])
    machine = telemetry.machine(epoch.step, parts.device, waits)
    parts.log.write({"event": "train", "step": progress.step, "epoch": progress.epoch, "lr": lr, **machine, **terms})


def _cool_down(parts: Parts, progress: Progress) -> None:
    """Over the last `cooldown` share of the time budget, the learning rate falls linearly to 0 from
    where it was (a warmup-stable-decay schedule without the warmup: Hägele et al., 2024, found a
    cooldown of about a fifth of training as good as cosine decay, without fixing the length of
    training in advance), so that a run still improving when its time runs out ends on weights
    that have settled."""
    if not parts.budget.cools:
        return
    elapsed = distributed.all_sum(parts.d, [parts.budget.elapsed()], parts.device)[0] / parts.d.world
    left = parts.budget.rate_left(elapsed)
    if left == 1.0:
        return
    groups = parts.optimizer.param_groups
    if progress.cooldown_from is None:
        progress.cooldown_from = [float(g["lr"]) for g in groups]
    for group, lr in zip(groups, progress.cooldown_from):
        group["lr"] = lr * left  # a float: the step puts it where its graphs read it


def _finish(
    parts: Parts, schedule: ScheduleConfig, progress: Progress, metrics: dict, stop: resilience.GracefulStop | None
) -> Progress:
    """Save what is left, say which best.pt was chosen and why, and end (an error if a final save failed)."""
    d, checkpoints = parts.d, parts.checkpoints
    if stop is not None:  # a stop saves last.pt (unless it was just saved) and leaves best.pt as it is
        if checkpoints.saved(checkpoints.last_path) != progress.step:
            checkpoints.save(checkpoints.last_path, progress, metrics, final=True)
        parts.log.write(
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
    if parts.tuning is not None and d.main and stop is None:
        seconds = add_tuned_familiarity(
            [checkpoints.best_path, checkpoints.last_path],
            parts.data,
            checkpoints.saver,
            parts.device,
            seed=parts.optim.seed,
            workers=parts.tuning.cfg.workers,
        )
        parts.log.write({"event": "familiarity", "step": progress.step, "seconds": round(seconds, 2)})
    parts.log.write(
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
        log.info(chosen(progress, schedule.metric, boxes=parts.targets is not None))
    ft = parts.tuning.cfg if parts.tuning is not None else None
    if d.main and stop is None and ft is not None and (progress.epoch, progress.batch_in_epoch) <= (ft.after, 0):
        log.warning(  # not one step trained the encoder
            f"the encoder did not train: the run ended within the {ft.after} epochs the decoder trains alone "
            "first (--tune-after); `fit --resume` with more --epochs or --max-minutes goes on, "
            "or set --tune-after lower"
        )
    parts.log.close()
    # Every rank waits for rank 0's saves and ends the same way: a failed final save is an error.
    failed, resumable = distributed.broadcast(
        d, (checkpoints.saver.failed, checkpoints.last_path in checkpoints.saver.good)
    )
    if failed:
        message = failed.get(checkpoints.last_path) or next(iter(failed.values()))
        raise CaptionerError(message + ("; `fit --resume` continues from it" if resumable else ""))
    return progress
