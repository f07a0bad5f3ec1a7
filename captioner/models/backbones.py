"""The backbones an encoder can be, one row each; everything else reads its row.

The trunk is a `nn.Sequential` of the model's own layers under torchvision's names ("24.weight" for
VGG, "layer4.0.conv1.weight" for ResNet), so a torchvision state dict fits it as it is.

The grid: VGG's conv5 map is the grid (224 / 16 = 14), and so is ConvNeXt-T's third stage (384-d, the 16-pixel cells of
VGG's conv5; its last stage is 32 times smaller and 768-d). ResNet's last stage is 32 times smaller than its input, so
its map is average-pooled to 14×14 (torch's adaptive pool), at the 256×256 input of sgrvinod's tutorial; ruotianluo's
code pools full-size COCO images to 14×14 the same way. A larger input (448) makes the map 14×14 itself, the pool then
an identity: `--image-size 448` (docs/training.md weighs the two).

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

    name: str  # as messages, cards and the help say it
    builder: Callable[..., nn.Module]  # torchvision's model builder
    weights: WeightsEnum  # ImageNet's, through torchvision's download cache
    cut: str  # the last layer the trunk keeps, after the model's attribute holding the layers ("features.29")
    channels: int  # D, channels of the map at the cut
    stride: int  # input pixels per cell of that map
    input_size: int  # the default input side
    pooled: int | None  # the grid side an adaptive average pool makes; None: the map is the grid
    stages: tuple[tuple[str, str], ...]  # --fine-tune-from → the first trained layer's name in the trunk
    draw: Callable[[nn.Module, np.random.RandomState, int], None]  # seeded weights: `seed_trunk`

    @property
    def prefix(self) -> str:
        """Where the trunk's keys sit in a state dict of the whole model ("features." for VGG)."""
        return self.cut.rpartition(".")[0] + "." if "." in self.cut else ""

    def grid(self, image_size: int) -> int:
        return self.pooled or image_size // self.stride

    def stage(self, start: str) -> str:
        """The trunk's first trained layer of a `--fine-tune-from` stage."""
        layers = dict(self.stages)
        if start not in layers:
            raise CaptionerError(f"--fine-tune-from must be one of {sorted(layers)} for {self.name}, got {start!r}")
        return layers[start]

    def trunk(self, model: nn.Module) -> nn.Sequential:
        """The model's layers up to the cut, under their names, then the pool where the row has one."""
        body, _, last = self.cut.rpartition(".")
        layers = OrderedDict()
        for name, layer in (getattr(model, body) if body else model).named_children():
            layers[name] = layer
            if name == last:
                break
        if self.pooled:
            layers["pool"] = nn.AdaptiveAvgPool2d(self.pooled)  # (B, D, g, g) whatever the map's side
        return nn.Sequential(layers)


def draw_conv_bn(trunk: nn.Module, rs: np.random.RandomState, blocks: int) -> None:
    """VGG's and ResNet's: convolutions He-normal (fan-in: activations keep their scale through the ReLUs), their biases
    zero; BatchNorm the identity with running statistics (mean 0, variance 1), except the last of each residual branch,
    scaled by 1/√(branches) so that a random ResNet's sum of branches stays within fp16's range."""
    residual = [m for m in trunk.modules() if hasattr(m, "downsample")]  # torchvision's residual blocks
    last_norms = {id([c for c in b.children() if isinstance(c, nn.BatchNorm2d)][-1]) for b in residual}
    for m in trunk.modules():
        if isinstance(m, nn.Conv2d):
            _he_normal(m, rs, m.in_channels // m.groups * m.kernel_size[0] * m.kernel_size[1])
        elif isinstance(m, nn.BatchNorm2d):
            scale = 1 / math.sqrt(blocks) if id(m) in last_norms else 1.0
            m.weight.data, m.bias.data = torch.full((m.num_features,), scale), torch.zeros(m.num_features)
            m.running_mean.data, m.running_var.data = torch.zeros(m.num_features), torch.ones(m.num_features)
            m.num_batches_tracked.data = torch.zeros((), dtype=torch.long)


def draw_convnext(trunk: nn.Module, rs: np.random.RandomState, blocks: int) -> None:
    """ConvNeXt's: convolutions and linear layers He-normal, their biases zero; LayerNorm the identity; each
    block's layer scale 1/√(blocks), as a ResNet's last BatchNorm of a branch, so that the sum of the
    branches stays within fp16's range."""
    for m in trunk.modules():
        if isinstance(m, nn.Conv2d):
            _he_normal(m, rs, m.in_channels // m.groups * m.kernel_size[0] * m.kernel_size[1])
        elif isinstance(m, nn.Linear):
            _he_normal(m, rs, m.in_features)
        elif isinstance(m, nn.LayerNorm):
            m.weight.data, m.bias.data = torch.ones(m.normalized_shape), torch.zeros(m.normalized_shape)
        elif hasattr(m, "layer_scale"):  # torchvision's CNBlock
            m.layer_scale.data = torch.full(tuple(m.layer_scale.shape), 1 / math.sqrt(blocks))


def _he_normal(m: nn.Module, rs: np.random.RandomState, fan_in: int) -> None:
    w = rs.standard_normal(tuple(m.weight.shape)) * np.sqrt(2.0 / fan_in)
    m.weight.data = torch.from_numpy(w.astype(np.float32))
    if m.bias is not None:
        m.bias.data = torch.zeros(tuple(m.bias.shape))


VGG16_STAGES = (("conv5_1", "24"), ("conv4_1", "17"))  # conv{b}_1 follows the (b-1)-th max-pool
VGG19_STAGES = (("conv5_1", "28"), ("conv4_1", "19"))
RESNET_STAGES = (("conv5_1", "layer4"), ("conv4_1", "layer3"))  # He et al.'s conv5_x is torchvision's layer4
# ConvNeXt cut after its third stage ("5"): its last stage is that one, from the downsampling before it.
CONVNEXT_STAGES = (("conv5_1", "4"), ("conv4_1", "2"))

# The table: adding a backbone is a row here (and its test in tests/test_backbones.py).
# fmt: off
BACKBONES = {
    "vgg16": Backbone("VGG16", tv.vgg16, tv.VGG16_Weights.IMAGENET1K_V1,
                      cut="features.29", channels=512, stride=16, input_size=224, pooled=None,
                      stages=VGG16_STAGES, draw=draw_conv_bn),
    "vgg19": Backbone("VGG19", tv.vgg19, tv.VGG19_Weights.IMAGENET1K_V1,
                      cut="features.35", channels=512, stride=16, input_size=224, pooled=None,
                      stages=VGG19_STAGES, draw=draw_conv_bn),
    "resnet50": Backbone("ResNet-50", tv.resnet50, tv.ResNet50_Weights.IMAGENET1K_V1,
                         cut="layer4", channels=2048, stride=32, input_size=256, pooled=14,
                         stages=RESNET_STAGES, draw=draw_conv_bn),
    "resnet101": Backbone("ResNet-101", tv.resnet101, tv.ResNet101_Weights.IMAGENET1K_V1,
                          cut="layer4", channels=2048, stride=32, input_size=256, pooled=14,
                          stages=RESNET_STAGES, draw=draw_conv_bn),
    "resnet152": Backbone("ResNet-152", tv.resnet152, tv.ResNet152_Weights.IMAGENET1K_V1,
                          cut="layer4", channels=2048, stride=32, input_size=256, pooled=14,
                          stages=RESNET_STAGES, draw=draw_conv_bn),
    "convnext_tiny": Backbone("ConvNeXt-T", tv.convnext_tiny, tv.ConvNeXt_Tiny_Weights.IMAGENET1K_V1,
                              cut="features.5", channels=384, stride=16, input_size=224, pooled=None,
                              stages=CONVNEXT_STAGES, draw=draw_convnext),
}
# fmt: on


# --encoder's help, from the table: each row, its annotation vectors, and how its grid is made.
ARCH_HELP = "; ".join(
    f"{arch} ({row.name}: {row.channels}-d, {row.grid(row.input_size)}x{row.grid(row.input_size)} at "
    f"{row.input_size}x{row.input_size}{', average-pooled, a departure from the paper' if row.pooled else ''})"
    for arch, row in BACKBONES.items()
)


def backbone(arch: str) -> Backbone:
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
    return {k: tuple(v.shape) for k, v in meta_trunk(arch).state_dict().items()}


@functools.cache
def layer_names(arch: str) -> tuple[str, ...]:
    return tuple(name for name, _ in meta_trunk(arch).named_children())


def layer_index(key: str) -> int:
    """The position in its trunk of the layer a state-dict key names ("24.weight" → 24,
    "layer4.0.conv1.weight" → 7): each family names its layers alike in every row."""
    first = key.split(".")[0]
    if first.isdigit():
        return int(first)
    return next(names.index(first) for names in map(layer_names, BACKBONES) if first in names)


def seed_trunk(trunk: nn.Sequential, seed: int, arch: str, layers: int | None = None) -> None:
    """Random weights for `arch`'s trunk from NumPy's `RandomState(seed)`, the same on every machine and
    release; with `layers`, only the first that many layers (the stream is the same up to there). Raises
    CaptionerError for a parameter or buffer the row's `draw` left undrawn (a layer type it does not know)."""
    part = trunk[:layers]
    with torch.no_grad():
        for t in part.state_dict().values():  # what `draw` leaves undrawn shows
            t.fill_(-1 if not t.is_floating_point() else float("nan"))
    blocks = sum(1 for m in trunk.modules() if hasattr(m, "downsample") or hasattr(m, "layer_scale"))
    backbone(arch).draw(part, np.random.RandomState(seed), blocks)
    undrawn = [k for k, t in part.state_dict().items() if (t.isnan() if t.is_floating_point() else t < 0).any()]
    if undrawn:
        raise CaptionerError(f"{arch}: drawing its seeded weights left {undrawn[0]} undrawn")
