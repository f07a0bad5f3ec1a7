"""A run's checkpoints on disk, last.pt and best.pt (`models.checkpoint`'s schema), and the validation that chooses.

best.pt is the best-scoring checkpoint among those whose attention the health check finds meaningful
(`evaluation.metrics`), when any is; otherwise the best-scoring one, recorded as not meaningful, and `fit` says so
when it ends (`chosen`).

Rank 0 alone writes them; each other rank keeps its own random streams beside last.pt, since a resumed rank goes on
with its own draws. A failed save (full disk, quota, read-only directory) leaves the previous file whole and is
reported in one line naming the last good checkpoint; training goes on, retries at the next save, and `fit` raises
if its final save fails.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict
from typing import NamedTuple

import torch

from captioner.data.boxes import BoxTargets
from captioner.data.dataset import CaptionData
from captioner.decoding.beams import Hypothesis
from captioner.decoding.settings import Decoding
from captioner.errors import CaptionerError
from captioner.evaluation.metrics import (
    advice,
    attention_health,
    caption_split,
    health_summary,
    problems,
    score_validation,
    verdict,
)
from captioner.io import atomic_path, describe_os_error
from captioner.models.checkpoint import Checkpoint, save_checkpoint
from captioner.objectives.terms import TermState
from captioner.train import distributed
from captioner.train.config import Progress, ScheduleConfig
from captioner.train.log import FaultLog, RunLog, first_nonfinite
from captioner.train.word_maps import agreement


def streams(generator: torch.Generator) -> dict:
    """This process's random streams: torch's (dropout), the terms' generator's, each GPU's default one's."""
    return {
        "torch": torch.get_rng_state(),
        "generator": generator.get_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def rank_streams_path(out_dir: str, rank: int) -> str:
    """Where rank `rank` (> 0) keeps its random streams of last.pt's step (rank 0's are in last.pt)."""
    return os.path.join(out_dir, f"last.rank{rank}.rng.pt")


class Live(NamedTuple):
    """The live objects of a run whose state a checkpoint holds."""

    decoder: torch.nn.Module  # the weights the optimizer steps
    average: object | None  # `train.step.WeightAverage`: what validation and inference use
    tuning: object | None  # `train.finetune.FineTuning`: the encoder's trained layers
    optimizer: torch.optim.Optimizer
    scheduler: object
    generator: torch.Generator
    terms: TermState


class Checkpoints:
    """Writes a run's last.pt and best.pt, and says which are whole. `record`: what every checkpoint of the run says
    of it ("decoder", "train", "vocab", ...); `notes`: where a failed save is reported; `resumed`: a resumed run's
    progress (its last.pt and best.pt are known to be whole)."""

    def __init__(
        self,
        out_dir: str,
        *,
        main: bool,
        live: Live | None,
        record: dict,
        notes: FaultLog | None = None,
        resumed: Progress | None = None,
    ):
        self.main, self.live, self.record, self.notes = main, live, record, notes
        self.last_path, self.best_path = os.path.join(out_dir, "last.pt"), os.path.join(out_dir, "best.pt")
        here = distributed.current()
        self.rank, self.world = here.rank, here.world
        self.streams_path = rank_streams_path(out_dir, self.rank)
        self.good: dict[str, int] = {}  # path → step of its last whole save (the resumed one's included)
        self.failed: dict[str, str] = {}  # path → message of its latest failed save
        self.last_save = time.monotonic()
        if resumed is not None:
            self.good[self.last_path] = resumed.step
            if os.path.exists(self.best_path):
                self.good[self.best_path] = resumed.best_step

    def last_good(self, path: str) -> str:
        if path in self.good:
            return f"the last good checkpoint is {path} at step {self.good[path]}"
        return f"{path} has not been saved by this run yet"

    def write(self, ck: dict, path: str) -> bool:
        """Write `ck` (with a "step" and a "model" state dict) to `path`; False if the write failed. Raises
        CaptionerError where the model's weights are not finite: such a checkpoint is never written over a good one."""
        bad = first_nonfinite(ck["model"])
        if bad is not None:
            raise CaptionerError(
                f"the model's weights are not finite at step {ck['step']} ({bad}); not "
                f"saving {path}; {self.last_good(path)}"
            )
        try:
            save_checkpoint(ck, path)
        except OSError as e:
            self.failed[path] = f"cannot save {path} at step {ck['step']}: {describe_os_error(e, path)}; "
            self.failed[path] += self.last_good(path)
            return False
        self.good[path] = int(ck["step"])
        self.failed.pop(path, None)
        return True

    def checkpoint(self, progress: Progress, metrics: dict) -> Checkpoint:
        p, r = self.live, self.record
        average, tuning = p.average, p.tuning
        return Checkpoint(
            model=(average or p.decoder).state_dict(),
            decoder=r["decoder"],
            vocab=r["vocab"],
            encoder=r["encoder"],
            max_len=r["max_len"],
            step=progress.step,
            encoder_state=tuning.encoder.encoder_state() if tuning else None,  # the trained layers, trunk names
            familiarity=r["familiarity"],
            metrics=metrics,
            attention=verdict(metrics.get("attention_health")),
            command=r["command"],
            data=r["data"],
            train=r["train"],
            progress=asdict(progress),
            optimizer=p.optimizer.state_dict(),
            scheduler=p.scheduler.state_dict(),
            rng={**streams(p.generator), "world": self.world},  # rank 0's; each other rank's beside last.pt
            terms=p.terms.state_dict(),
            training_model=p.decoder.state_dict() if average else None,  # the raw weights, for --resume
        )

    def save(self, path: str, progress: Progress, metrics: dict, *, final: bool = False) -> None:
        """Save a checkpoint (rank 0); a failed save is reported, and is `fit`'s error if it was the final one."""
        if self.main and not self.write(self.checkpoint(progress, metrics).to_dict(), path):
            then = "fit ends with this error" if final else "training goes on and retries at the next save"
            self.notes.warn("save_failed", f"{self.failed[path]}; {then}", step=progress.step, show=not final)
        if path == self.last_path:
            if not self.main:
                self._save_streams(progress.step)
            self.last_save = time.monotonic()

    def _save_streams(self, step: int) -> None:
        """This rank's random streams at last.pt's `step`, in a file of its own: gathering them to rank 0
        would need every rank at every save, and some saves are rank 0's alone. A failed write is not
        reported: the resumed rank finds no streams of that step, reseeds them and says so."""
        try:
            with atomic_path(self.streams_path) as tmp:
                torch.save({"step": step, "world": self.world, "rng": streams(self.live.generator)}, tmp)
        except OSError:
            pass

    def saved(self, path: str) -> int | None:
        """The step of `path`'s last good save by this run (or the resumed one), None if none."""
        return self.good.get(path)


logger = logging.getLogger(__name__)


def validate(
    live: Live, data: CaptionData, schedule: ScheduleConfig, process: distributed.Process, targets: BoxTargets | None
) -> tuple[dict, dict[int, Hypothesis]]:
    """Generation-based validation of the weights' average (or the weights), split over processes and scored on the
    gathered captions, with the map agreement on the word maps' validation `targets` (`fit --word-maps`). Returns the
    metrics (every process's the same) and this process's captions by image id."""
    t0, d = time.monotonic(), process.dist
    texts, hyps = caption_split(
        live.average.model if live.average else live.decoder,
        data,
        data.vocab,
        "val",
        decoding=Decoding(beam_size=schedule.val_beam_size),
        max_len=data.max_len,
        max_images=schedule.val_images,
        shard=(d.rank, d.world),
        features=live.tuning.features if live.tuning else None,
        compiled=process.searches_compile,
    )
    texts = distributed.gather_dicts(d, texts)
    maps = distributed.gather_dicts(d, {i: h.attention.astype("float16") for i, h in hyps.items()})
    if targets is not None:  # every rank has them or none does
        rows = {int(i): int(r) for i, r in data.images["val"]}
        counted = distributed.gather_dicts(d, {d.rank: agreement(targets, rows, hyps, data.encoder.grid)})
    metrics = None
    if d.main:
        metrics = score_validation(texts, data.references["val"])
        metrics["attention_health"] = attention_health(maps.values())
        if targets is not None:
            hits, words = map(sum, zip(*counted.values()))
            metrics["map_agreement"] = hits / words if words else None  # None: no word the maps know was written
    return {**distributed.broadcast(d, metrics), "seconds": round(time.monotonic() - t0, 2)}, hyps


def select(progress: Progress, metrics: dict, metric: str, *, log: RunLog, lr: float, boxed: bool) -> bool:
    """Is this validation the new best.pt by `metric` (module doc)? A healthy one replaces a flagged best.pt whatever
    its score. Logged with the learning rate `lr` (`boxed`: the run trains with --boxes, which the advice names)."""
    score, found = metrics[metric], problems(metrics["attention_health"])
    healthy = not found
    improved = (healthy and not progress.best_healthy) or (healthy == progress.best_healthy and score > progress.best)
    if improved:
        progress.best, progress.best_step, progress.best_healthy, progress.stale = score, progress.step, healthy, 0
    else:
        progress.stale += 1
    log.write(
        {
            "event": "val",
            "step": progress.step,
            "epoch": progress.epoch,
            **metrics,
            "lr": lr,
            "best": progress.best,
            "best_step": progress.best_step,
            "healthy": healthy,
        }
    )
    if log.main:
        other = metric if metric != "BLEU-4" else "CIDEr"
        logger.info(
            f"epoch {progress.epoch}: step {progress.step}, BLEU-4 {metrics['BLEU-4']:.3f}, {other} "
            f"{metrics[other]:.3f}{' (best.pt)' if improved else ''}; e.g. {metrics['example']!r}; "
            f"{health_summary(metrics['attention_health'])}"
        )
        if found:
            logger.warning(f"step {progress.step}: {'; '.join(found)}: {advice(boxes=boxed)}")
    return improved


def chosen(p: Progress, metric: str, *, boxes: bool) -> str:
    """Which best.pt `fit` chose by `metric`, and why, in one line (`boxes`: the run trained with --boxes)."""
    if p.best_healthy:
        return (
            f"best.pt: step {p.best_step}, {metric} {p.best:.3f}: the best score among the validations "
            "whose attention health is ok"
        )
    return (
        f"best.pt: step {p.best_step}, {metric} {p.best:.3f}: the attention health check flagged every "
        "validation, so its heatmaps are NOT MEANINGFUL (the checkpoint records it, and the demo, "
        f"`captioner caption --figures` and the notebooks say so): {advice(boxes=boxes)}"
    )
