"""What a fine-tuned encoder reads: the input cache beside the features, or the images themselves.

Fine-tuning from conv5_1 runs the trained layers on the output of the layers before them (VGG's
pool4, ResNet's conv4_x), cached once in the data directory in the feature cache's format; from
conv4_1 it runs on the images, decoded by DataLoader workers ahead of the step.
Shapes: n images, L locations, D feature size, S image side.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from captioner.data.dataset import TODO, CaptionData, FeatureCache
from captioner.data.images import load_image
from captioner.errors import CaptionerError, ImageError
from captioner.models.encoder import layer_input_shape
from captioner.models.preprocess import Preprocess

# The input cache's files (DATA/pool4.npy, .done, .json) for every backbone: named after VGG's pool4, which
# data directories made before ResNet and ConvNeXt hold under that name.
INPUT_CACHE = "pool4"


def input_cache_info(data: CaptionData, start: int) -> dict:
    """What an input cache was made for: the encoder, the first trained layer and the images."""
    return {"encoder": data.encoder.fingerprint, "layers": start, "rows": len(data.meta["image_ids"])}


class _Images(Dataset):
    """Preprocessed images of rows, decoded in DataLoader workers; a bad image yields its message."""

    def __init__(self, paths, groups: list[np.ndarray], preprocess: Preprocess):
        self.paths, self.groups, self.preprocess = paths, groups, preprocess

    def __len__(self) -> int:
        return len(self.groups)

    def __getitem__(self, i: int):
        try:
            return torch.stack([self.preprocess(load_image(self.paths[r])) for r in self.groups[i]]), ""  # (n, 3, S, S)
        except ImageError as e:
            return torch.zeros(0), str(e)


def image_groups(paths, groups: list[np.ndarray], preprocess: Preprocess, workers: int) -> Iterator[torch.Tensor]:
    """(n, 3, S, S) image tensors of each group of rows, decoded ahead by `workers` processes."""
    loader = DataLoader(_Images(paths, groups, preprocess), batch_size=None, num_workers=workers)
    for images, error in loader:
        if error:
            raise CaptionerError(f"{error} (fine-tuning reads the images themselves; it was readable at prepare time)")
        yield images


def complete_input_cache(data: CaptionData, start: int) -> FeatureCache | None:
    """The input cache of a data directory if it is complete for these layers, else None."""
    info_path = os.path.join(data.dir, f"{INPUT_CACHE}.json")
    if not os.path.exists(info_path):
        return None
    with open(info_path, encoding="utf-8") as f:
        info = json.load(f)
    if info != input_cache_info(data, start):
        return None
    cache = FeatureCache(data.dir, info["rows"], *layer_input_shape(data.encoder, start), name=INPUT_CACHE)
    return cache if not (cache.done == TODO).any() else None


@torch.inference_mode()
def encoded_features(
    encoder: nn.Module,
    data: CaptionData,
    rows: np.ndarray,
    *,
    cache: FeatureCache | None,
    device: torch.device,
    workers: int = 2,
) -> torch.Tensor:
    """Features (n, L, D) of rows by `encoder`, on the cached pool4 rows (`cache`) or, when None, on the
    images."""
    if cache is not None:
        return encoder(torch.from_numpy(cache[rows].astype(np.float32)).to(device)).float()  # (n, L, D)
    # Groups of 8 images, so that the workers decode in parallel.
    groups = np.array_split(np.asarray(rows), max(1, math.ceil(len(rows) / 8)))
    return torch.cat(
        [
            encoder(images.to(device)).float()  # (8, L, D)
            for images in image_groups(data.meta["paths"], groups, data.encoder.preprocess, workers)
        ]
    )
