"""The encoder's input, defined once for feature extraction, the API, the app and notebooks.

`array` needs no torch (the ONNX runtime's). `pixels` does the same resize on a uint8 tensor where it lies (on a GPU):
PyTorch's antialiased bilinear is Pillow's filter computed in floats, without Pillow's rounding to uint8 between its two
passes, so the inputs differ by one grey level at most. Shapes: B images, S the input side.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image

if TYPE_CHECKING:
    import torch

# ImageNet statistics, which both the pretrained and the seeded random VGG expect.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
_MEAN, _STD = (np.array(v, dtype=np.float32).reshape(3, 1, 1) for v in (IMAGENET_MEAN, IMAGENET_STD))


@dataclass(frozen=True)
class Preprocess:
    """Image → normalised encoder input (3, S, S).

    `crop` False resizes the whole image to size×size, so the attention grid covers all of it; True
    is the paper's resize-shorter-side-to-256 then centre-crop-224."""

    size: int = 224
    crop: bool = False

    @property
    def resize_to(self) -> int:
        return round(self.size * 256 / 224)

    def grid_box(self, width: int, height: int) -> tuple[float, float, float, float]:
        """The region (left, top, right, bottom) of the original image that the encoder sees."""
        if not self.crop:
            return 0.0, 0.0, float(width), float(height)
        scale = self.resize_to / min(width, height)  # original pixels → resized pixels
        side = self.size / scale  # the crop's side in original pixels
        left, top = (width - side) / 2, (height - side) / 2
        return left, top, left + side, top + side

    def resized(self, width: int, height: int) -> tuple[int, int]:
        """The (width, height) an image is resized to before any crop."""
        if not self.crop:
            return self.size, self.size
        scale = self.resize_to / min(width, height)
        return max(1, round(width * scale)), max(1, round(height * scale))

    def _crop(self, width: int, height: int) -> tuple[int, int]:
        return (width - self.size) // 2, (height - self.size) // 2

    def array(self, img: Image.Image) -> np.ndarray:
        """An RGB PIL image → float32 array (3, S, S), ImageNet-normalised."""
        img = img.resize(self.resized(*img.size), Image.BILINEAR, reducing_gap=None)
        if self.crop:
            left, top = self._crop(*img.size)
            img = img.crop((left, top, left + self.size, top + self.size))
        x = (np.asarray(img, dtype=np.float32) / np.float32(255.0)).transpose(2, 0, 1)  # (3, S, S)
        return (x - _MEAN) / _STD

    def __call__(self, img: Image.Image) -> torch.Tensor:
        import torch

        return torch.from_numpy(self.array(img))  # (3, S, S)

    def pixels(self, x: torch.Tensor) -> torch.Tensor:
        """RGB uint8 images of one size (B, H, W, 3), or one (H, W, 3) → (B, 3, S, S) or (3, S, S): `__call__`'s
        resize and crop, done on the pixels' device."""
        import torch.nn.functional as F

        one = x.dim() == 3
        x = x.unsqueeze(0) if one else x  # (B, H, W, 3)
        w, h = self.resized(x.size(2), x.size(1))
        x = x.permute(0, 3, 1, 2).float()  # (B, 3, H, W)
        x = F.interpolate(x, size=(h, w), mode="bilinear", antialias=True, align_corners=False)  # (B, 3, h, w)
        if self.crop:
            left, top = self._crop(w, h)
            x = x[:, :, top : top + self.size, left : left + self.size]
        x = _normalised(x.clamp(0, 255) / 255.0)  # (B, 3, S, S)
        return x[0] if one else x


def _normalised(x: torch.Tensor) -> torch.Tensor:
    """(..., 3, S, S) in [0, 1] → ImageNet-normalised, on x's device."""
    mean, std = _statistics(x.device)
    return (x - mean) / std


@functools.cache
def _statistics(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """ImageNet's mean and std (3, 1, 1) on `device`, copied there once (not once per image)."""
    import torch

    return tuple(torch.tensor(v, device=device).view(3, 1, 1) for v in (IMAGENET_MEAN, IMAGENET_STD))
