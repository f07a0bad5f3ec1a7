"""`fit`: teacher-forced training on cached features, validated by generation each epoch.

Batches of an epoch are a function of (seed, epoch), so a resumed run replays the rest of the epoch it was in.
Under `torchrun` each process takes its share of every global batch through DistributedDataParallel; validation
is split over processes; rank 0 logs and saves.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from captioner import compiled
from captioner.data.batches import prefetched
from captioner.data.dataset import CaptionData
from captioner.errors import CaptionerError
from captioner.models.decoder import DecoderConfig
from captioner.objectives.terms import TermState
from captioner.train import distributed, setup
from captioner.train.checkpoints import Checkpoints, Live, chosen, select, validate
from captioner.train.config import Progress, TrainConfig
from captioner.train.finetune import FineTuning, add_tuned_familiarity
from captioner.train.log import FaultLog, GracefulStop, RunLog, Waits, machine, open_board, stop_requested
from captioner.train.resume import Start, rank_seed, restore, settle, start_from
from captioner.train.step import Budget, TrainStep, WeightAverage, make_optimizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FitJob:
    """What `fit` is asked to do: the data, the run directory, what it starts from, and its settings.

    `model` gives the decoder's sizes (vocab_size from the data; ignored on resume and with `init`, a checkpoint whose
    weights start the run with a fresh optimizer); `boxes` object boxes of the training images (COCO instances) that
    teach attention; `command` the command line as typed."""

    data: str
    out: str
    model: DecoderConfig | None = None
    train: TrainConfig = field(default_factory=TrainConfig)
    init: str | None = None
    boxes: str | None = None
    resume: bool = False
    device: str = "auto"
    progress_bar: bool = True
    command: str | None = None


def fit(job: FitJob, stop: GracefulStop | None = None) -> Progress:
    """Train a decoder on a prepared data directory into a run directory: last.pt, best.pt, metrics.jsonl. Once
    `stop` is requested, each process ends its step, rank 0 saves last.pt, and fit returns. Raises CaptionerError,
    naming the last good checkpoint, where the final save of last.pt or best.pt failed (a full disk)."""
    return Trainer(job, stop).fit()


class Trainer:
    """One training run: its data and settled configs, this process, the model's state, progress, log and saver."""

    def __init__(self, job: FitJob, stop: GracefulStop | None = None):
        self.job, self.stop = job, stop
        self.metrics: dict = {}  # the last validation's, which a checkpoint saved meanwhile records

    def start(self) -> None:
        """Settle the settings, build the run's parts (a resumed run's state put back) and log its first line."""
        job = self.job
        d, device = distributed.setup(job.device)
        data = self.data = CaptionData(job.data)
        init, saved, began = self.init, self.saved, self.began = start_from(job, data, device)
        if job.boxes is not None and job.train.terms.word_maps:
            raise CaptionerError("--boxes and --word-maps both say where words lie: pass one of them")
        targeted = job.boxes is not None or job.train.terms.word_maps
        start = Start(len(data.vocab), data.cache.shape[-1], data.views is not None, targeted, init, saved)
        model_cfg, cfg = self.model_cfg, self.cfg = settle(job.model, job.train, start, device)
        torch.manual_seed(cfg.optim.seed)  # the process's own settings, for this run:
        if cfg.optim.amp == "tf32":
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        self.process = distributed.Process(d, device, setup.step_compiling(cfg.process, device))
        board = open_board(cfg.process.tensorboard, main=d.main, saved=saved)  # before any slow preparation
        self.targets = setup.attention_targets(data, began["boxes"], cfg, d)
        live = self.live = self._live()
        self.stages = [setup.stage(data, live.decoder, cfg, state=live.terms, targets=self.targets)]
        if live.tuning is not None:
            self.stages.append(
                setup.stage(data, live.decoder, cfg, state=live.terms, targets=self.targets, tuning=live.tuning)
            )
        if d.rank:  # each rank draws its own dropout masks and samples, compiled (default generator) or not
            torch.manual_seed(rank_seed(cfg.optim.seed, d.rank, 0))
        # Started after the one-off pool4 cache of a fine-tuned encoder, which is preparation, like prepare's.
        self.log = RunLog(job.out, main=d.main, started=time.monotonic(), board=board)
        self.notes = FaultLog(self.log.write, show=d.main)
        self.progress = restore(live, saved, job.out, self.notes) if saved is not None else Progress()
        stats = setup.familiarity(data, live.tuning, saved, cfg.optim.seed, d.main)
        record = setup.record(data, model_cfg, cfg, began, stats)
        self.saver = Checkpoints(
            job.out,
            main=d.main,
            live=live,
            record=record,
            notes=self.notes,
            resumed=self.progress if saved is not None else None,
        )
        self.budget = Budget(cfg, started=self.log.started)
        self.stage = setup.stage_at(self.stages, self.progress.epoch, cfg.fine_tune)
        self.step = self._step()
        self.metrics = (saved or {}).get("metrics") or {}
        self.log.write(self._start_record())

    def fit(self) -> Progress:
        """Train until the epochs, the time budget or the patience run out, or a stop is asked."""
        self.start()
        cfg, progress, stopped = self.cfg, self.progress, False
        with self.notes.recording(compiled.log):  # what compiled, and what fell back: in the log too
            while progress.epoch < cfg.process.epochs:
                ft = cfg.fine_tune
                if len(self.stages) > 1 and progress.epoch == ft.after > 0 and progress.batch_in_epoch == 0:
                    self._encoder_joins()
                ended = self.train_one_epoch()
                if stopped := ended == "stopped":
                    break
                stopped, final = self.validate_and_save(ended)
                if final:
                    break
        return self.finish(stopped)

    def _live(self) -> Live:
        """The objects a checkpoint holds the state of, fresh."""
        data, cfg, d, device = self.data, self.cfg, self.process.dist, self.process.device
        saved = self.saved
        decoder = setup.make_decoder(data, self.model_cfg, device, self.init)
        groups = [{"params": list(decoder.parameters())}]
        tuning = None
        if cfg.fine_tune is not None:
            tuning = FineTuning(
                data, cfg, self.process, targets=self.targets, progress=self.job.progress_bar and d.main
            )
            groups.append({"params": list(tuning.parameters()), "lr": cfg.fine_tune.lr})
        optimizer = make_optimizer(groups, cfg.optim.lr)
        return Live(
            decoder,
            WeightAverage(decoder, cfg.optim.ema) if cfg.optim.ema else None,
            tuning,
            optimizer,
            torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", factor=0.5, patience=2),
            torch.Generator(device=device).manual_seed(cfg.optim.seed + 1 + d.rank),
            TermState(device, saved.get("terms") if saved is not None else None),
        )

    def _step(self) -> TrainStep:
        return setup.train_step(self.stage, self.live, self.cfg.optim, self.process, self.progress.step)

    def _start_record(self) -> dict:
        """The log's first line: the run's settled configs, as its checkpoints record them, and where it starts."""
        record, progress, world = self.saver.record, self.progress, self.process.dist.world
        return {
            "event": "start",
            "step": progress.step,
            "epoch": progress.epoch,
            "resume": self.job.resume,
            "decoder": record["decoder"],
            "train": record["train"],
            "device": str(self.process.device),
            "world": world,
            "train_captions": int(len(self.data.lengths)),
            "batches_per_epoch": self.stage.source.num_batches(world=world),
        }

    def _encoder_joins(self) -> None:
        """The decoder has trained alone for `fine_tune.after` epochs: from here the encoder trains with it."""
        progress, ft = self.progress, self.cfg.fine_tune
        if not self.stage.tuned:  # (a run resumed here starts with it)
            self.stage = setup.stage_at(self.stages, progress.epoch, ft)
            self.step = self._step()
        shapes = self.stage.source.shapes
        self.log.write({"event": "encoder_trains", "step": progress.step, "epoch": progress.epoch, "shapes": shapes})
        if self.process.dist.main:
            logger.info(f"epoch {progress.epoch + 1}: the encoder's layers from {ft.start} train from here")

    def train_one_epoch(self) -> str | None:
        """The rest of the current epoch's steps; "stopped" or "out of time" if it ended early."""
        progress, saves, saver = self.progress, self.cfg.process, self.saver
        d, device = self.process.dist, self.process.device
        pin = device.type == "cuda"
        self.bar = tqdm(
            total=self.stage.source.num_batches(world=d.world),
            initial=progress.batch_in_epoch,
            desc=f"epoch {progress.epoch + 1}",
            disable=not (self.job.progress_bar and d.main),
            dynamic_ncols=True,
            leave=False,
        )
        batches = self.stage.source.batches(
            seed=self.cfg.optim.seed,
            epoch=progress.epoch,
            start=progress.batch_in_epoch,
            rank=d.rank,
            world=d.world,
            pin=pin,
        )
        self.waits = Waits()
        try:
            for batch in self.waits.timed(prefetched(batches)):
                # Captions of damaged feature rows were left out; a non-finite step is not applied.
                if batch.dropped:
                    progress.skipped_captions += len(batch.dropped)
                    self.notes.damaged_rows(batch.dropped, self.data, progress.step)
                self.budget.cool(self.live.optimizer, progress, d, device)
                self.step(batch.to(device, non_blocking=pin))
                progress.step, progress.batch_in_epoch = progress.step + 1, progress.batch_in_epoch + 1
                self.bar.update(1)
                # The host waits for the device here, every `log_every` steps (and at saves, and at each step of a
                # DDP run's cooldown); under DDP the processes also agree here on a save by the clock, a stop, or time.
                agree = progress.step % saves.log_every == 0
                if agree:
                    self._log_terms()
                if self._save_due(agree) or (saves.checkpoint_every and progress.step % saves.checkpoint_every == 0):
                    saver.save(saver.last_path, progress, self.metrics)  # rank 0 alone writes
                for why, asked in (("stopped", stop_requested(self.stop)), ("out of time", self.budget.out())):
                    if (agree or not d.active) and distributed.any_true(d, asked, device):
                        self._log_terms()
                        return why
            self._log_terms()
        finally:
            self.bar.close()
        return None

    def _save_due(self, agree: bool) -> bool:
        """Whether `--checkpoint-minutes` have passed since the last save. Under DDP each rank's clock is its
        own: the ranks agree on it where they agree on everything, at log lines."""
        minutes, d = self.cfg.process.checkpoint_minutes, self.process.dist
        due = bool(minutes) and time.monotonic() - self.saver.last_save > minutes * 60
        return agree and distributed.any_true(d, due, self.process.device) if d.active else due

    def _log_terms(self) -> None:
        """Read the terms back from the device: a log line of their means since the last one, and any skipped steps."""
        progress = self.progress
        terms, skipped = self.step.read()
        if skipped:
            progress.skipped_steps += skipped
            self.notes.skipped_steps(progress.step, skipped, terms, scaled=self.step.scaler.is_enabled())
        if not terms or all(math.isnan(v) for v in terms.values()):
            return
        self.bar.set_postfix(loss=f"{terms['loss']:.3f}")
        lr = float(self.live.optimizer.param_groups[0]["lr"])
        machine_fields = machine(self.process.device, self.waits)
        self.log.write(
            {"event": "train", "step": progress.step, "epoch": progress.epoch, "lr": lr, **machine_fields, **terms}
        )

    def validate_and_save(self, ended: str | None) -> tuple[bool, bool]:
        """The end of an epoch (or of the time budget, `ended`): validate, step the schedule, choose and save best.pt,
        save last.pt. Returns whether a stop was asked and whether this is the run's last epoch."""
        schedule, progress, saver, d = self.cfg.schedule, self.progress, self.saver, self.process.dist
        try:
            word_maps = self.targets if self.cfg.terms.word_maps else None
            metrics, hyps = validate(self.live, self.data, schedule, self.process, word_maps)
        except Exception:  # the epoch's steps are kept, and counted once scored: a resume validates them first
            saver.save(saver.last_path, progress, {}, final=True)
            raise
        self.metrics = metrics
        if ended is None:
            progress.epoch, progress.batch_in_epoch = progress.epoch + 1, 0
        if progress.cooldown_from is None:  # the cooldown sets the rate from here on
            self.live.scheduler.step(metrics[schedule.metric])
        lr = float(self.live.optimizer.param_groups[0]["lr"])
        improved = select(progress, metrics, schedule.metric, log=self.log, lr=lr, boxed=self.job.boxes is not None)
        self.log.examples(progress.step, self.data, hyps)
        # A signal during validation: last.pt is saved next, so stop there.
        stopped = distributed.any_true(d, stop_requested(self.stop), self.process.device)
        stale = progress.stale >= schedule.patience
        final = stopped or ended is not None or progress.epoch >= self.cfg.process.epochs or stale
        if improved:
            saver.save(saver.best_path, progress, metrics, final=final)
        saver.save(saver.last_path, progress, metrics, final=final)
        if stale:
            self.log.write({"event": "early_stop", "step": progress.step, "epoch": progress.epoch})
        return stopped, final

    def finish(self, stopped: bool) -> Progress:
        """Save what is left, say which best.pt was chosen and why, and end (an error if a final save failed)."""
        progress, saver, log, d = self.progress, self.saver, self.log, self.process.dist
        stop = self.stop if stopped else None
        if stop is not None:  # a stop saves last.pt (unless it was just saved) and leaves best.pt as it is
            if saver.saved(saver.last_path) != progress.step:
                saver.save(saver.last_path, progress, self.metrics, final=True)
            saved = saver.last_path not in saver.failed
            log.write(
                {
                    "event": "stopped",
                    "signal": stop.signal_name,
                    "step": progress.step,
                    "epoch": progress.epoch,
                    "saved": saved,
                }
            )
        elif d.main and saver.saved(saver.best_path) is None:  # e.g. resumed after the run had finished
            saver.save(saver.best_path, progress, self.metrics, final=True)
        if self.live.tuning is not None and d.main and stop is None:
            self._tuned_familiarity()
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
        if d.main and stop is None:
            self._say_how_it_ended()
        log.close()
        # Every rank waits for rank 0's saves and ends the same way: a failed final save is an error.
        failed, resumable = distributed.broadcast(d, (saver.failed, saver.last_path in saver.good))
        if failed:
            message = failed.get(saver.last_path) or next(iter(failed.values()))
            raise CaptionerError(message + ("; `fit --resume` continues from it" if resumable else ""))
        return progress

    def _tuned_familiarity(self) -> None:
        """A fine-tuned encoder's checkpoints get its own features' statistics."""
        paths = [self.saver.best_path, self.saver.last_path]
        workers, seed = self.cfg.process.workers, self.cfg.optim.seed
        seconds = add_tuned_familiarity(paths, self.data, self.saver, self.process.device, seed=seed, workers=workers)
        self.log.write({"event": "familiarity", "step": self.progress.step, "seconds": round(seconds, 2)})

    def _say_how_it_ended(self) -> None:
        """Which best.pt was chosen and why; and whether a fine-tuned encoder trained at all."""
        progress, ft = self.progress, self.cfg.fine_tune
        if progress.best_step:
            logger.info(chosen(progress, self.cfg.schedule.metric, boxes=self.job.boxes is not None))
        if ft is not None and (progress.epoch, progress.batch_in_epoch) <= (ft.after, 0):
            logger.warning(  # not one step trained the encoder
                f"the encoder did not train: the run ended within the {ft.after} epochs the decoder trains alone "
                "first (--tune-after); `fit --resume` with more --epochs or --max-minutes goes on, "
                "or set --tune-after lower"
            )
