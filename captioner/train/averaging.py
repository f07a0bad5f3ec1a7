"""An exponential moving average of the decoder's weights (Polyak averaging, as in Polyak and
Juditsky, 1992, and the EMA most vision and language training keeps): `fit --ema DECAY`.

At a constant learning rate the weights jitter around where the loss is low; the average of
the last few hundred steps sits nearer its middle. With the average on, it is what validation
captions, what chooses `best.pt`, and what every checkpoint holds as its model, while the
optimizer goes on stepping the raw weights (saved beside it so `--resume` continues exactly).

The decay ramps in, min(decay, (1 + step) / (10 + step)), so the first steps' random weights
do not linger in the average.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


class WeightAverage:
    """A copy of `model` whose parameters follow its exponential moving average.

    Args:
        model: the module being trained (its buffers are copied once: they do not train).
        decay: how much of the average each step keeps, at most.
    """

    def __init__(self, model: nn.Module, decay: float):
        if not 0 < decay < 1:
            raise ValueError(f"--ema is a decay between 0 and 1 (exclusive), got {decay}")
        self.decay = decay
        self.model = copy.deepcopy(model).requires_grad_(False)

    @torch.no_grad()
    def update(self, model: nn.Module, step: int) -> None:
        """Move the average towards `model`'s weights after optimizer step `step` (counted from 1)."""
        keep = min(self.decay, (1 + step) / (10 + step))
        for average, weight in zip(self.model.parameters(), model.parameters()):
            average.lerp_(weight.detach(), 1.0 - keep)

    def state_dict(self) -> dict:
        return self.model.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state)
