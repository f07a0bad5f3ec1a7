"""The backbones an encoder can be, one row each; everything else reads its row.

A row (`Backbone`) names torchvision's builder and ImageNet weights, where its trunk is cut, the
channels D of the annotation vectors, how the grid is made, the input side users know, and the
stages `fit --fine-tune-encoder` can train. The trunk is a `nn.Sequential` of the model's own
layers under torchvision's names ("24.weight" for VGG, "layer4.0.conv1.weight" for ResNet), so a
torchvision state dict fits it as it is.

The grid: VGG's conv5 map is the grid (224 / 16 = 14). ResNet's last stage is 32 times smaller than
its input, so its map is average-pooled to 14×14 (torch's adaptive pool), at the 256×256 input of
sgrvinod's tutorial; ruotianluo's code pools full-size COCO images to 14×14 the same way. A larger
input (448) makes the map 14×14 itself, the pool then an identity: `--image-size 448`
(docs/training.md weighs the two).

Stages keep the ResNet paper's names, which VGG's layers share: conv5_1 begins VGG's conv5 block
and ResNet's conv5_x stage (torchvision's layer4), conv4_1 the block or stage before it.

Shapes: B images, S input side, g grid side, L = g·g locations, D channels.
"""

from __future__ import annotations

import functools
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torchvision
from torch import nn
from torchvision.models import WeightsEnum

from captioner.errors import CaptionerError

tv = torchvision.models


@dataclass(frozen=True)
class Backbone:
    """One backbone: how its trunk is built and cut, and what it gives."""

    name: str  # as messages and cards say it
    builder: Callable[..., nn.Module]  # torchvision's model builder
    weights: WeightsEnum  # ImageNet's, through torchvision's download cache
    body: str  # the model's attribute holding the trunk's layers ("": the model's own children)
    cut: str  # the last layer the trunk keeps
    channels: int  # D, channels of the map at the cut
    stride: int  # input pixels per cell of that map
    input_size: int  # the default input side
    pooled: int | None  # the grid side an adaptive average pool makes; None: the map is the grid
    stages: tuple[tuple[str, str], ...]  # --fine-tune-from → the first trained layer's name in the trunk

    @property
    def prefix(self) -> str:
        """Where the trunk's keys sit in a state dict of the whole model ("features." for VGG)."""
        return f"{self.body}." if self.body else ""

    def grid(self, image_size: int) -> int:
        """The side of the grid of annotation vectors at an input side."""
        return self.pooled or image_size // self.stride

    def stage(self, start: str) -> str:
        """The trunk's first trained layer of a `--fine-tune-from` stage."""
        layers = dict(self.stages)
        if start not in layers:
            raise CaptionerError(f"--fine-tune-from must be one of {sorted(layers)} for {self.name}, got {start!r}")
        return layers[start]

    def trunk(self, model: nn.Module) -> nn.Sequential:
        """The model's layers up to the cut, under their names, then the pool where the row has one."""
        layers = OrderedDict()
        for name, layer in (getattr(model, self.body) if self.body else model).named_children():
            layers[name] = layer
            if name == self.cut:
                break
        if self.pooled:
            layers["pool"] = nn.AdaptiveAvgPool2d(self.pooled)  # (B, D, g, g) whatever the map's side
        return nn.Sequential(layers)


VGG16_STAGES = (("conv5_1", "24"), ("conv4_1", "17"))  # conv{b}_1 follows the (b-1)-th max-pool
VGG19_STAGES = (("conv5_1", "28"), ("conv4_1", "19"))
RESNET_STAGES = (("conv5_1", "layer4"), ("conv4_1", "layer3"))  # He et al.'s conv5_x is torchvision's layer4

# The table: adding a backbone is a row here (and its test in tests/test_backbones.py).
# fmt: off
BACKBONES = {
    "vgg16": Backbone("VGG16", tv.vgg16, tv.VGG16_Weights.IMAGENET1K_V1,
                      body="features", cut="29", channels=512, stride=16, input_size=224, pooled=None,
                      stages=VGG16_STAGES),
    "vgg19": Backbone("VGG19", tv.vgg19, tv.VGG19_Weights.IMAGENET1K_V1,
                      body="features", cut="35", channels=512, stride=16, input_size=224, pooled=None,
                      stages=VGG19_STAGES),
    "resnet50": Backbone("ResNet-50", tv.resnet50, tv.ResNet50_Weights.IMAGENET1K_V1,
                         body="", cut="layer4", channels=2048, stride=32, input_size=256, pooled=14,
                         stages=RESNET_STAGES),
    "resnet101": Backbone("ResNet-101", tv.resnet101, tv.ResNet101_Weights.IMAGENET1K_V1,
                          body="", cut="layer4", channels=2048, stride=32, input_size=256, pooled=14,
                          stages=RESNET_STAGES),
    "resnet152": Backbone("ResNet-152", tv.resnet152, tv.ResNet152_Weights.IMAGENET1K_V1,
                          body="", cut="layer4", channels=2048, stride=32, input_size=256, pooled=14,
                          stages=RESNET_STAGES),
}
# fmt: on


def backbone(arch: str) -> Backbone:
    """The row of `--encoder arch`."""
    if arch not in BACKBONES:
        raise CaptionerError(f"unknown encoder {arch!r}; choose one of {sorted(BACKBONES)}")
    return BACKBONES[arch]


def meta_trunk(arch: str) -> nn.Sequential:
    """`arch`'s trunk on the meta device, in eval mode: its shapes, nothing allocated (not the classifier's)."""
    row = backbone(arch)
    with torch.device("meta"):
        return row.trunk(row.builder(weights=None)).eval()


@functools.cache
def trunk_shapes(arch: str) -> dict[str, tuple[int, ...]]:
    """The trunk's state dict as names and shapes, in order."""
    return {k: tuple(v.shape) for k, v in meta_trunk(arch).state_dict().items()}


@functools.cache
def layer_names(arch: str) -> tuple[str, ...]:
    """The trunk's layers' names, in order."""
    return tuple(name for name, _ in meta_trunk(arch).named_children())


def layer_index(key: str) -> int:
    """The position in its trunk of the layer a state-dict key names ("24.weight" → 24,
    "layer4.0.conv1.weight" → 7): each family names its layers alike in every row."""
    first = key.split(".")[0]
    if first.isdigit():
        return int(first)
    return next(names.index(first) for names in map(layer_names, BACKBONES) if first in names)


def seed_trunk(trunk: nn.Sequential, seed: int, layers: int | None = None) -> None:
    """Random weights drawn from NumPy's `RandomState(seed)`, the same on every machine and release.

    Convolutions are He-normal (fan-in: activations keep their scale through the ReLUs), their biases
    zero. BatchNorm is the identity with running statistics (mean 0, variance 1), except the last of
    each residual branch, scaled by 1/√(branches) so that a random ResNet's sum of branches stays
    within fp16's range. With `layers`, only the first that many layers are drawn (the stream is the
    same up to there), the rest left as they are.
    """
    rs = np.random.RandomState(seed)
    part = trunk[:layers]
    blocks = [m for m in trunk.modules() if hasattr(m, "downsample")]  # torchvision's residual blocks
    last_norms = {id([c for c in b.children() if isinstance(c, nn.BatchNorm2d)][-1]) for b in blocks}
    for m in part.modules():
        if isinstance(m, nn.Conv2d):
            fan_in = m.in_channels // m.groups * m.kernel_size[0] * m.kernel_size[1]
            w = rs.standard_normal(tuple(m.weight.shape)) * np.sqrt(2.0 / fan_in)
            m.weight.data = torch.from_numpy(w.astype(np.float32))
            if m.bias is not None:
                m.bias.data = torch.zeros(m.out_channels)
        elif isinstance(m, nn.BatchNorm2d):
            scale = 1 / math.sqrt(len(blocks)) if id(m) in last_norms else 1.0
            m.weight.data = torch.full((m.num_features,), scale)
            m.bias.data = torch.zeros(m.num_features)
            m.running_mean.data = torch.zeros(m.num_features)
            m.running_var.data = torch.ones(m.num_features)
            m.num_batches_tracked.data = torch.zeros((), dtype=torch.long)
