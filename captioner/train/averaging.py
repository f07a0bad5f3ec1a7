"""An exponential moving average of the decoder's weights (Polyak and Juditsky, 1992): `fit --ema DECAY`.

At a constant learning rate the weights jitter around where the loss is low, and which validation happens to catch
them low or high decides `best.pt`; the average sits nearer the middle. So validation captions with it and every
checkpoint holds it as its model, while the optimizer steps the raw weights (saved beside it, for `--resume`).
After step t it keeps min(DECAY, (1 + t) / (10 + t)) of itself: early on it spans about the last tenth of the
steps, so the first random weights do not linger. The encoder layers of `--fine-tune-encoder` are not averaged.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


class WeightAverage:
    """A copy of `model` whose parameters follow its exponential moving average (its buffers are copied once: they
    do not train); `decay`: how much of the average each step keeps, at most."""

    def __init__(self, model: nn.Module, decay: float):
        self.decay = decay
        self.model = copy.deepcopy(model).requires_grad_(False)
        self.device = next(model.parameters()).device

    @torch.no_grad()
    def update(self, model: nn.Module, step: torch.Tensor | int, applied: torch.Tensor | bool = True) -> None:
        """Move the average towards `model`'s weights after optimizer step `step` (counted from 1); not
        at all where `applied` is False (a skipped step). On the device, with no read back to the host."""
        step = torch.as_tensor(step, dtype=torch.float32, device=self.device)
        keep = ((1 + step) / (10 + step)).clamp(max=self.decay)
        weight = (1.0 - keep) * torch.as_tensor(applied, device=self.device)  # (), 0 when not applied
        for average, w in zip(self.model.parameters(), model.parameters()):
            average.lerp_(w.detach(), weight.to(average.dtype))

    def state_dict(self) -> dict:
        return self.model.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state)
