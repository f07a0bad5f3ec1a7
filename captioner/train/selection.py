"""Validation by generation, and the choice of best.pt.

best.pt is the best-scoring checkpoint among those whose attention the health check finds
meaningful (`evaluation.health`), when any is; otherwise the best-scoring one, recorded as not
meaningful, and `fit` says so when it ends (`chosen`).
"""

from __future__ import annotations

import logging
import time

from captioner.data.dataset import CaptionData
from captioner.decoding.beams import Hypothesis
from captioner.decoding.settings import Decoding
from captioner.evaluation.captioning import caption_split, score_validation
from captioner.evaluation.health import advice, attention_health, problems
from captioner.evaluation.health import summary as health_summary
from captioner.train import distributed
from captioner.train.checkpoints import Live
from captioner.train.config import Progress, ScheduleConfig
from captioner.train.log import RunLog

logger = logging.getLogger(__name__)


def validate(
    live: Live, data: CaptionData, schedule: ScheduleConfig, process: distributed.Process
) -> tuple[dict, dict[int, Hypothesis]]:
    """Generation-based validation of the weights' average (or the weights), split over processes and scored on the
    gathered captions. Returns the metrics (every process's the same) and this process's captions by image id."""
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
    metrics = None
    if d.main:
        metrics = score_validation(texts, data.references["val"])
        metrics["attention_health"] = attention_health(maps.values())
    return {**distributed.broadcast(d, metrics), "seconds": round(time.monotonic() - t0, 2)}, hyps


def select(progress: Progress, metrics: dict, metric: str, *, log: RunLog, lr: float, boxed: bool) -> bool:
    """Is this validation the new best.pt by `metric`? The best score among checkpoints whose attention
    is healthy, when any is; a healthy one replaces a flagged best.pt whatever its score. Logged with the
    learning rate `lr` (`boxed`: the run trains with --boxes, which the advice on flagged maps names)."""
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
