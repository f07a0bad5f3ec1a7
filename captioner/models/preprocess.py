"""The encoder's input, defined once for feature extraction, the API, the app and notebooks.

`Preprocess` turns an upright RGB image (`data.images.load_image`) into the encoder's input
tensor (3, S, S) and knows which part of the image the attention grid covers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch
from PIL import Image

# ImageNet statistics, which both the pretrained and the seeded random VGG expect.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class Preprocess:
    """Image → normalised encoder input.

    Args:
        size: side of the square input (224 gives VGG's 14×14 conv5 grid).
        crop: False resizes the whole image to size×size, so the attention grid covers all of
            it; True is the paper's resize-shorter-side-to-256 then centre-crop-224.
    """

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

    def __call__(self, img: Image.Image) -> torch.Tensor:
        """An RGB PIL image → float tensor (3, size, size), ImageNet-normalised."""
        if self.crop:
            w, h = img.size
            scale = self.resize_to / min(w, h)
            img = img.resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.BILINEAR, reducing_gap=None)
            w, h = img.size
            left, top = (w - self.size) // 2, (h - self.size) // 2
            img = img.crop((left, top, left + self.size, top + self.size))
        else:
            img = img.resize((self.size, self.size), Image.BILINEAR)
        x = torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0)  # (S, S, 3)
        x = x.permute(2, 0, 1)  # (3, S, S)
        mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
        std = torch.tensor(IMAGENET_STD).view(3, 1, 1)
        return (x - mean) / std

    def to_dict(self) -> dict:
        return asdict(self)
