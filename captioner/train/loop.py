"""`fit`: teacher-forced training on cached features, validated by generation each epoch.

The run, in the order a reader meets it: `train.run.start_run` sets it up (fresh, `--init`, or
`--resume`); `_train_epoch` steps through an epoch's batches; `_validate` captions the
validation split and `_select` decides whether this is the new best.pt; `_finish` saves what is
left and ends. Checkpoints (`last.pt` every epoch, every `checkpoint_minutes` and every
`checkpoint_every` steps, `best.pt` when `_select` says so) hold everything needed to resume
exactly: model, optimizer, scheduler, progress, RNG states, the REINFORCE baseline. Batches of
an epoch are a function of (seed, epoch), so a resumed run replays the rest of the epoch it was
in. Under `torchrun` the same loop runs DistributedDataParallel: each process takes its share of
every global batch; validation is split over processes and gathered; rank 0 logs and saves.

best.pt is the best-scoring checkpoint among those whose attention the health check finds
meaningful (`evaluation.health`), when any is; otherwise the best-scoring one, recorded as not
meaningful, and `fit` says so when it ends.
"""

from __future__ import annotations

import logging
import math
import time

from tqdm import tqdm

from captioner.errors import CaptionerError
from captioner.evaluation.captioning import caption_split, score_validation
from captioner.evaluation.health import advice, attention_health, problems
from captioner.evaluation.health import summary as health_summary
from captioner.models.decoder import DecoderConfig
from captioner.train import distributed, resilience
from captioner.train.config import Progress, TrainConfig
from captioner.train.finetune import add_tuned_familiarity
from captioner.train.run import Run, set_objective, start_run
from captioner.train.step import train_step

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
        model_cfg: decoder sizes (vocab_size is taken from the data); ignored on resume.
        cfg: optimisation settings (default: `TrainConfig()`); on resume the saved ones are
            used, except epochs, max_minutes and how often to save. With cfg.init, training
            starts from that checkpoint's weights and decoder config (a fresh optimizer);
            cfg.objective "scst" needs cfg.init or a resume.
        resume: continue from out_dir/last.pt (cfg.init is then ignored).
        device: "auto", "cpu" or "cuda" (under torchrun each process takes its local GPU).
        stop: once it is requested (SIGTERM, SIGINT), every process finishes its step, rank 0
            saves last.pt, and fit returns; `resume` continues from there exactly.

    Raises:
        CaptionerError: the final save of last.pt or best.pt failed (e.g. a full disk); the
            message names the last good checkpoint. Failed saves before it only warn.
    """
    run = start_run(
        data_dir, out_dir, model_cfg, cfg or TrainConfig(), resume=resume, device=device, progress_bar=progress_bar
    )
    cfg, progress = run.cfg, run.progress
    run.write_log(
        {
            "event": "start",
            "step": progress.step,
            "epoch": progress.epoch,
            "resume": resume,
            "decoder": run.model_cfg.to_dict(),
            "train": cfg.to_dict(),
            "device": str(run.device),
            "world": run.d.world,
            "train_captions": int(len(run.data.lengths)),
            "batches_per_epoch": run.source.num_batches(cfg.batch_size, world=run.d.world),
        }
    )
    budget = cfg.max_minutes * 60 if cfg.max_minutes else math.inf
    stopped = False
    while progress.epoch < cfg.epochs:
        if run.tuning and progress.epoch == cfg.fine_tune.after > 0 and progress.batch_in_epoch == 0:
            set_objective(run)  # the decoder has trained alone for `after` epochs; the encoder joins it
            run.write_log({"event": "encoder_trains", "step": progress.step, "epoch": progress.epoch})
            if run.d.main:
                log.info(f"epoch {progress.epoch + 1}: the encoder's layers from {cfg.fine_tune.start} train from here")
        ended = _train_epoch(run, budget, stop, progress_bar)
        if ended == "stopped":
            stopped = True
            break
        if ended is None:
            progress.epoch += 1
            progress.batch_in_epoch = 0
        improved = _select(run, _validate(run, progress_bar))
        # A signal during validation: last.pt is saved next, so stop there.
        stopped = distributed.any_true(run.d, resilience.stop_requested(stop), run.device)
        final = stopped or ended is not None or progress.epoch >= cfg.epochs or progress.stale >= cfg.patience
        if improved:
            run.save(run.best_path, final)
        run.save(run.last_path, final)
        if progress.stale >= cfg.patience:
            run.write_log({"event": "early_stop", "step": progress.step, "epoch": progress.epoch})
        if final:
            break
    return _finish(run, stop if stopped else None)


def _train_epoch(run: Run, budget: float, stop, progress_bar: bool) -> str | None:
    """The rest of the current epoch's steps; "stopped" or "out of time" if it ended early."""
    cfg, progress, d, dev = run.cfg, run.progress, run.d, run.device
    bar = tqdm(
        total=run.source.num_batches(cfg.batch_size, world=d.world),
        initial=progress.batch_in_epoch,
        desc=f"epoch {progress.epoch + 1}",
        disable=not (progress_bar and d.main),
        dynamic_ncols=True,
        leave=False,
    )
    pin = dev.type == "cuda"
    try:
        for batch in run.source.batches(
            cfg.batch_size,
            seed=cfg.seed,
            epoch=progress.epoch,
            start=progress.batch_in_epoch,
            rank=d.rank,
            world=d.world,
            pin=pin,
        ):
            # Captions of damaged feature rows were left out; a non-finite step is not applied.
            if batch.dropped:
                progress.skipped_captions += len(batch.dropped)
                run.notes.damaged_rows(batch.dropped, run.data, progress.step)
            _cool_down(run, budget)
            terms = train_step(
                run.objective,
                batch.to(dev, non_blocking=pin),
                run.optimizer,
                run.scaler,
                cfg,
                progress,
                run.generator,
                d,
                dev,
            )
            if not resilience.all_finite(terms):
                progress.skipped_steps += 1
                run.notes.skipped_step(progress.step + 1, terms, scaled=run.scaler.is_enabled())
            elif run.average:
                run.average.update(run.model, progress.step + 1)
            progress.step += 1
            progress.batch_in_epoch += 1
            bar.update(1)
            bar.set_postfix(loss=f"{terms['loss']:.3f}")
            if progress.step % cfg.log_every == 0:
                run.write_log(
                    {
                        "event": "train",
                        "step": progress.step,
                        "epoch": progress.epoch,
                        "lr": run.optimizer.param_groups[0]["lr"],
                        **terms,
                    }
                )
            due = cfg.checkpoint_minutes and time.monotonic() - run.last_save > cfg.checkpoint_minutes * 60
            if due or (cfg.checkpoint_every and progress.step % cfg.checkpoint_every == 0):
                run.save(run.last_path)  # rank 0 alone writes, so ranks need not agree on when
            # SIGTERM/SIGINT on any process stops all of them after this step.
            if distributed.any_true(d, resilience.stop_requested(stop), dev):
                return "stopped"
            if distributed.any_true(d, time.monotonic() - run.started > budget, dev):
                return "out of time"
    finally:
        bar.close()
    return None


def _cool_down(run: Run, budget: float) -> None:
    """Over the last `cfg.cooldown` share of the time budget, the learning rate falls linearly to
    0 from where it was (a warmup-stable-decay schedule without the warmup: Hägele et al., 2024,
    found a cooldown of about a fifth of training as good as cosine decay, without fixing the
    length of training in advance), so that a run still improving when its time runs out ends on
    weights that have settled. Off by default: docs/results.md has what it did to 8-minute runs."""
    share, progress = run.cfg.cooldown, run.progress
    if not (share > 0 and math.isfinite(budget)):
        return
    elapsed = distributed.all_sum(run.d, [time.monotonic() - run.started], run.device)[0] / run.d.world
    left = min(1.0, max(0.0, (budget - elapsed) / (share * budget)))
    if left == 1.0:
        return
    groups = run.optimizer.param_groups
    if progress.cooldown_from is None:
        progress.cooldown_from = [g["lr"] for g in groups]
    for group, lr in zip(groups, progress.cooldown_from):
        group["lr"] = lr * left


def _validate(run: Run, progress_bar: bool) -> dict:
    """Generation-based validation, split over processes and scored on the gathered captions."""
    t0, d, cfg = time.monotonic(), run.d, run.cfg
    texts, hyps = caption_split(
        run.average.model if run.average else run.model,
        run.data,
        run.data.vocab,
        "val",
        beam_size=cfg.val_beam_size,
        max_len=run.data.max_len,
        device=run.device,
        max_images=cfg.val_images,
        shard=(d.rank, d.world),
        features=run.tuning.features if run.tuning else None,
    )
    texts = distributed.gather_dicts(d, texts)
    maps = distributed.gather_dicts(d, {i: h.attention.astype("float16") for i, h in hyps.items()})
    metrics = None
    if d.main:
        metrics = score_validation(texts, run.data.references["val"])
        metrics["attention_health"] = attention_health(maps.values())
    metrics = {**distributed.broadcast(d, metrics), "seconds": round(time.monotonic() - t0, 2)}
    run.metrics = metrics
    return metrics


def _select(run: Run, metrics: dict) -> bool:
    """Is this validation the new best.pt? The best score among checkpoints whose attention is
    healthy, when any is; a healthy one replaces a flagged best.pt whatever its score."""
    progress, cfg = run.progress, run.cfg
    score, found = metrics[cfg.metric], problems(metrics["attention_health"])
    healthy = not found
    improved = (healthy and not progress.best_healthy) or (healthy == progress.best_healthy and score > progress.best)
    if improved:
        progress.best, progress.best_step, progress.best_healthy, progress.stale = score, progress.step, healthy, 0
    else:
        progress.stale += 1
    if progress.cooldown_from is None:  # the cooldown sets the rate from here on
        run.scheduler.step(score)
    run.write_log(
        {
            "event": "val",
            "step": progress.step,
            "epoch": progress.epoch,
            **metrics,
            "lr": run.optimizer.param_groups[0]["lr"],
            "best": progress.best,
            "best_step": progress.best_step,
            "healthy": healthy,
        }
    )
    if run.d.main:
        chosen = " (best.pt)" if improved else ""
        log.info(
            f"epoch {progress.epoch}: step {progress.step}, BLEU-4 {metrics['BLEU-4']:.3f}, "
            f"{cfg.metric if cfg.metric != 'BLEU-4' else 'CIDEr'} "
            f"{metrics[cfg.metric if cfg.metric != 'BLEU-4' else 'CIDEr']:.3f}{chosen}; "
            f"e.g. {metrics['example']!r}; {health_summary(metrics['attention_health'])}"
        )
        if found:
            log.warning(f"step {progress.step}: {'; '.join(found)}: {advice(boxes=bool(cfg.boxes))}")
    return improved


def _finish(run: Run, stop: resilience.GracefulStop | None) -> Progress:
    """Save what is left, say which best.pt was chosen and why, and end (an error if a final save failed)."""
    progress, d = run.progress, run.d
    if stop is not None:  # a stop saves last.pt (unless it was just saved) and leaves best.pt as it is
        if run.saver.good.get(run.last_path) != progress.step:
            run.save(run.last_path, final=True)
        run.write_log(
            {
                "event": "stopped",
                "signal": stop.signal_name,
                "step": progress.step,
                "epoch": progress.epoch,
                "saved": run.last_path not in run.saver.failed,
            }
        )
    elif d.main and run.best_path not in run.saver.good:  # e.g. resumed after the run had finished
        run.save(run.best_path, final=True)
    if run.tuning is not None and d.main and stop is None:
        seconds = add_tuned_familiarity(
            [run.best_path, run.last_path],
            run.data,
            run.saver,
            run.device,
            seed=run.cfg.seed,
            workers=run.cfg.fine_tune.workers,
        )
        run.write_log({"event": "familiarity", "step": progress.step, "seconds": round(seconds, 2)})
    run.write_log(
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
        log.info(_chosen(run))
    ft = run.cfg.fine_tune
    if d.main and stop is None and ft is not None and (progress.epoch, progress.batch_in_epoch) <= (ft.after, 0):
        log.warning(  # not one step trained the encoder
            f"the encoder did not train: the run ended within the {ft.after} epochs the decoder trains alone "
            "first (--tune-after); `fit --resume` with more --epochs or --max-minutes goes on, "
            "or set --tune-after lower"
        )
    if run.log_file:
        run.log_file.close()
    # Every rank waits for rank 0's saves and ends the same way: a failed final save is an error.
    failed, resumable = distributed.broadcast(d, (run.saver.failed, run.last_path in run.saver.good))
    if failed:
        message = failed.get(run.last_path) or next(iter(failed.values()))
        raise CaptionerError(message + ("; `fit --resume` continues from it" if resumable else ""))
    return progress


def _chosen(run: Run) -> str:
    """Which best.pt `fit` chose, and why, in one line."""
    p, metric = run.progress, run.cfg.metric
    if p.best_healthy:
        return (
            f"best.pt: step {p.best_step}, {metric} {p.best:.3f}: the best score among the validations "
            "whose attention health is ok"
        )
    return (
        f"best.pt: step {p.best_step}, {metric} {p.best:.3f}: the attention health check flagged every "
        "validation, so its heatmaps are NOT MEANINGFUL (the checkpoint records it, and the demo, "
        f"`captioner caption --figures` and the notebooks say so): {advice(boxes=bool(run.cfg.boxes))}"
    )
