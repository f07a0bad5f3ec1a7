"""The run's time (`--max-minutes`) and the cooldown of the learning rate at its end (`--cooldown`)."""

from __future__ import annotations

import math
import time

import torch

from captioner.train import distributed
from captioner.train.config import Progress, TrainConfig


class Budget:
    """The run's time (`--max-minutes`, counted from the start of its log) and the cooldown at its end."""

    def __init__(self, cfg: TrainConfig, *, started: float):
        minutes = cfg.process.max_minutes
        self.seconds = minutes * 60 if minutes else math.inf
        self.cooldown, self.started = cfg.schedule.cooldown, started

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def out(self) -> bool:
        return self.elapsed() > self.seconds

    @property
    def cools(self) -> bool:
        """The learning rate cools down at the end: there is a budget and a cooldown share of it."""
        return self.cooldown > 0 and math.isfinite(self.seconds)

    def rate_left(self, elapsed: float) -> float:
        """The share of its rate the learning rate keeps at `elapsed` seconds: 1 until the last `cooldown`
        share of the budget, then falling linearly to 0."""
        return min(1.0, max(0.0, (self.seconds - elapsed) / (self.cooldown * self.seconds)))

    def cool(self, optimizer: torch.optim.Optimizer, progress: Progress, d: distributed.Dist, device) -> None:
        """Over the last `cooldown` share of the time budget, the learning rate falls linearly to 0 from
        where it was (a warmup-stable-decay schedule without the warmup: Hägele et al., 2024, found a
        cooldown of about a fifth of training as good as cosine decay, without fixing the length of
        training in advance), so that a run still improving when its time runs out ends on weights
        that have settled. Under DDP the processes' clocks are averaged, every step."""
        if not self.cools:
            return
        left = self.rate_left(distributed.all_sum(d, [self.elapsed()], device)[0] / d.world)
        if left == 1.0:
            return
        if progress.cooldown_from is None:
            progress.cooldown_from = [float(g["lr"]) for g in optimizer.param_groups]
        for group, lr in zip(optimizer.param_groups, progress.cooldown_from):
            group["lr"] = lr * left  # a float: the step puts it where its compiled code reads it
