"""The encoder's trained layers (`fit --fine-tune-encoder`): which layers, and a module holding them.

Training starts at conv5_1 (on cached pool4 outputs) or conv4_1 (on the images). The trained
layers go into checkpoints as "encoder_state" under the names of `VGGEncoder.features`
("24.weight", ...); `encoder.apply_encoder_state` puts them back into a whole encoder.
Shapes: n images, B captions, L locations, D feature size, S image side.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from captioner.errors import CaptionerError
from captioner.models.views import view

STARTS = ("conv5_1", "conv4_1")


def start_index(features: nn.Sequential, start: str) -> int:
    """Index in `VGGEncoder.features` of layer `start`: conv{b}_1 follows the (b-1)-th max-pool."""
    if start not in STARTS:
        raise CaptionerError(f"--fine-tune-from must be one of {STARTS}, got {start!r}")
    block = int(start[4])
    pools = [i for i, m in enumerate(features) if isinstance(m, nn.MaxPool2d)]
    return pools[block - 2] + 1


def layers_of(state: dict) -> int:
    """The first trained layer's index, from an encoder_state's names ("24.weight" → 24)."""
    return min(int(k.split(".")[0]) for k in state)


class TunedEncoder(nn.Module):
    """The trained layers of the trunk (and, from images, the frozen ones before them).

    Args:
        trunk: `VGGEncoder.features`, with the weights the cached features were made with.
        start: index of the first trained layer.
        from_cache: inputs are cached (n, L, D) outputs of layer start-1 (pool4), else images.
    """

    def __init__(self, trunk: nn.Sequential, start: int, *, from_cache: bool):
        super().__init__()
        self.start = start
        # Slices of a Sequential keep its names, so state_dict() gives "24.weight" as in the trunk.
        self.frozen = None if from_cache else trunk[:start].requires_grad_(False)
        self.tuned = trunk[start:].requires_grad_(True)

    def forward(self, inputs: torch.Tensor, index: torch.Tensor | None = None, moves: torch.Tensor | None = None):
        """(n, L, D) cached inputs or (n, 3, S, S) images → (n, L, D), or (B, L, D) per caption by index.

        Args:
            moves: (n, 2) cells: the features of the inputs' views instead (`models.views`, the
                consistency's): the images themselves turned and moved, or, from the pool4
                cache, the pool4 maps turned and moved.
        """
        if self.frozen is None:
            n, L, D = inputs.shape
            g = math.isqrt(L)
            x = inputs.transpose(1, 2).reshape(n, D, g, g)  # (n, D, 14, 14) pool4 maps
            x = x if moves is None else view(x, moves, g)
        else:
            images = inputs if moves is None else view(inputs, moves, inputs.size(-1) // 16)
            with torch.no_grad():
                x = self.frozen(images)  # (n, 256, 28, 28) pool3 maps
        f = self.tuned(x).flatten(2).transpose(1, 2)  # (n, L, D)
        return f if index is None else f[index]  # (B, L, D)

    def grid(self, inputs: torch.Tensor) -> int:
        """The side of the feature grid the inputs give."""
        return math.isqrt(inputs.size(1)) if self.frozen is None else inputs.size(-1) // 16

    def encoder_state(self) -> dict:
        """The trained layers as plain tensors, under `VGGEncoder.features`' names."""
        return {k: v.detach().cpu().contiguous().clone() for k, v in self.tuned.state_dict().items()}

    def load_encoder_state(self, state: dict, source: str) -> None:
        if set(state) != set(self.tuned.state_dict()):
            raise CaptionerError(f"{source}: its encoder_state holds other layers than --fine-tune-from trains")
        self.tuned.load_state_dict(state)
