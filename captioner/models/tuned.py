"""The encoder's trained layers (`fit --fine-tune-encoder`): which layers, and a module holding them.

Training starts at conv5_1 (VGG's conv5 block, ResNet's conv5_x stage) on the cached output of the layers before it, or
at conv4_1 on the images. The trained layers go into checkpoints under the names of `Encoder.features` ("24.weight",
"layer4.0.conv1.weight", ...). BatchNorm keeps its running statistics while its scale and shift train: a batch of a few
images would give poor ones. Shapes: n images, B captions, L locations, D feature size, S image side.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from captioner.errors import CaptionerError
from captioner.models.backbones import backbone, layer_index
from captioner.models.views import view

STARTS = ("conv5_1", "conv4_1")
CACHED = "conv5_1"  # the stage whose inputs are cached once (the others read the images)


def start_index(features: nn.Sequential, start: str, arch: str) -> int:
    """Index in `Encoder.features` of stage `start`'s first layer, as `arch`'s row names it (`Backbone.stage`
    refuses a stage the row lacks)."""
    return list(features._modules).index(backbone(arch).stage(start))


def layers_of(state: dict) -> int:
    """The first trained layer's index, from an encoder_state's names ("24.weight" → 24, "layer4.…" → 7)."""
    return min(layer_index(k) for k in state)


class TunedEncoder(nn.Module):
    """The trained layers of the trunk from index `start` on (and, from images, the frozen ones before
    them); `from_cache`: the inputs are the cached (n, L', D') outputs of layer start-1, else images."""

    def __init__(self, trunk: nn.Sequential, start: int, *, from_cache: bool, arch: str):
        super().__init__()
        self.start = start
        # Slices of a Sequential keep its names, so state_dict() gives "24.weight" as in the trunk.
        self.frozen = None if from_cache else trunk[:start].requires_grad_(False)
        self.tuned = trunk[start:].requires_grad_(True)
        # The grid: a pooled trunk's pool size (ResNet's), else the map's at the row's stride.
        self.pooled, self.stride = backbone(arch).pooled, backbone(arch).stride

    def train(self, mode: bool = True) -> TunedEncoder:
        super().train(mode)
        for m in self.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.eval()  # running statistics kept (module doc)
        return self

    def forward(self, inputs: torch.Tensor, index: torch.Tensor | None = None, moves: torch.Tensor | None = None):
        """(n, L', D') cached inputs or (n, 3, S, S) images → (n, L, D), or (B, L, D) per caption by index;
        with `moves` (n, 2) cells, the features of the inputs' views instead."""
        g = self.grid(inputs)
        if self.frozen is None:
            n, L, D = inputs.shape
            side = math.isqrt(L)
            x = inputs.transpose(1, 2).reshape(n, D, side, side)  # (n, D', s, s): VGG's pool4, ResNet's conv4_x
            x = x if moves is None else view(x, moves, g)
        else:
            images = inputs if moves is None else view(inputs, moves, g)
            with torch.no_grad():
                x = self.frozen(images)  # (n, D', s, s): VGG's pool3 maps, ResNet's conv3_x
        f = self.tuned(x).flatten(2).transpose(1, 2)  # (n, L, D)
        return f if index is None else f[index]  # (B, L, D)

    def grid(self, inputs: torch.Tensor) -> int:
        if self.pooled:
            return self.pooled
        return math.isqrt(inputs.size(1)) if self.frozen is None else inputs.size(-1) // self.stride

    def encoder_state(self) -> dict:
        """The trained layers as plain tensors, under `Encoder.features`' names."""
        return {k: v.detach().cpu().contiguous().clone() for k, v in self.tuned.state_dict().items()}

    def load_encoder_state(self, state: dict, source: str) -> None:
        if set(state) != set(self.tuned.state_dict()):
            raise CaptionerError(f"{source}: its encoder_state holds other layers than --fine-tune-from trains")
        self.tuned.load_state_dict(state)
