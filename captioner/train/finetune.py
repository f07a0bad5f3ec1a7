"""Fine-tuning the encoder's last layers with the decoder (`fit --fine-tune-encoder`).

From conv5_1 (default), each step runs the last block or stage on the cached output of the layers before it
(DATA/pool4.npy, in the feature cache's format, made once by the first `fit` that needs it): no image is decoded in
the training loop. From conv4_1, DataLoader workers decode the images and the layers before it run without
gradients. A batch holds all the captions of a few images, so the encoder runs once per image, not per caption.

The decoder's feature standardisation (measured by `prepare` on the frozen encoder) stays fixed: at step 0 the tuned
layers are the frozen ones, and from then on they learn under that fixed affine map, which training, validation,
`evaluate` and `Captioner` all apply.
Shapes: n images, B captions, L locations, D feature size, S image side.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Literal

import numpy as np
import torch

from captioner.data.batches import Batch, Boxes, global_batches, rank_share
from captioner.data.dataset import BAD, TODO, CaptionData, FeatureCache
from captioner.data.encoder_inputs import INPUT_CACHE, encoded_features, image_groups, input_cache_info
from captioner.data.extraction import ImageFiles, extract_features
from captioner.errors import CaptionerError, OptionError
from captioner.evaluation.familiarity import fit_stats
from captioner.evaluation.metrics import checkpoint_features
from captioner.io import write_json_atomic
from captioner.models.checkpoint import load_checkpoint
from captioner.models.encoder import Encoder, apply_encoder_state, build_encoder, layer_input_shape
from captioner.models.fast_encoder import optimize_encoder
from captioner.models.tuned import CACHED, TunedEncoder, start_index
from captioner.train import distributed

DECODER_FIRST = 2  # epochs of a run from scratch before the encoder trains (FineTuneConfig.after)


@dataclass(frozen=True)
class FineTuneConfig:
    """Encoder fine-tuning (`--fine-tune-encoder`); saved in the checkpoint's training config."""

    start: Annotated[
        Literal["conv5_1", "conv4_1"],
        "--fine-tune-from",
        "first trained layer: conv5_1 (VGG's conv5 block; ResNet's last stage, conv5_x, torchvision's layer4) "
        "runs on the cached output of the layers before it, conv4_1 (a block or stage earlier) on the images",
    ] = "conv5_1"
    lr: Annotated[float, "--encoder-lr", "Adam learning rate of the encoder's layers"] = 1e-5
    after: Annotated[
        int | None,
        "--tune-after",
        "epochs the decoder trains alone on the cached features, with the prepared views' consistency, "
        "before the encoder's layers train with it, so that the encoder learns from a trained decoder's gradients",
    ] = None

    def __post_init__(self):
        if self.after is not None and self.after < 0:
            raise OptionError(f"--tune-after is a number of epochs, got {self.after}")


def image_batches(
    rows: np.ndarray, batch_size: int, *, seed: int, epoch: int, rank: int = 0, world: int = 1
) -> list[np.ndarray]:
    """Caption indices in batches of whole images, k = batch_size / mean captions per image (at least 1); a global
    batch of k·world images is split across ranks image by image. The same (seed, epoch) gives the same batches."""
    images, inverse = np.unique(rows, return_inverse=True)  # distinct feature rows
    by_image = np.split(np.argsort(inverse, kind="stable"), np.cumsum(np.bincount(inverse))[:-1])
    k = max(1, round(batch_size * len(images) / len(rows)))
    order = np.random.RandomState([seed, epoch]).permutation(len(images))
    return [np.concatenate([by_image[j] for j in c]) for c in rank_share(global_batches(order, k, world), rank, world)]


class FineTuning:
    """The fine-tuned encoder and where its inputs come from. `cfg`: the run's `TrainConfig`; `targets`: the box
    masks (`data.boxes.BoxTargets`) each batch carries under `fit --boxes`."""

    shapes = "packed"  # a batch's captions are as long as its longest (`objectives.objective`)

    def __init__(self, data: CaptionData, cfg, process: distributed.Process, *, targets=None, progress: bool = True):
        self.data, self.cfg, self.device = data, cfg.fine_tune, process.device
        self.batch_size, self.workers, self.targets = cfg.optim.batch_size, cfg.process.workers, targets
        base, _ = build_encoder(data.encoder)
        start = start_index(base.features, self.cfg.start, data.encoder.arch)
        self.cache = (
            input_cache(data, base, start, process, workers=self.workers, progress=progress)
            if self.cfg.start == CACHED
            else None
        )
        cached, arch = self.cache is not None, data.encoder.arch
        self.encoder = TunedEncoder(base.features, start, from_cache=cached, arch=arch).to(process.device)

    def parameters(self):
        return self.encoder.tuned.parameters()

    def num_batches(self, world: int = 1) -> int:
        return len(image_batches(self.data.rows, self.batch_size, seed=0, epoch=0, world=world))

    def batches(
        self, *, seed: int, epoch: int, start: int = 0, rank: int = 0, world: int = 1, pin: bool = False
    ) -> Iterator[Batch]:
        """Batches of whole images: `features` holds the encoder's inputs, one per image."""
        groups = image_batches(self.data.rows, self.batch_size, seed=seed, epoch=epoch, rank=rank, world=world)
        groups = groups[start:]
        rows = [np.unique(self.data.rows[idx]) for idx in groups]  # each batch's distinct images
        if self.cache is not None:
            inputs = (torch.from_numpy(self.cache[r].astype(np.float32)) for r in rows)  # (n, L', D') cached maps
        else:
            inputs = image_groups(self.data.meta["paths"], rows, self.data.encoder.preprocess, self.workers)
        for idx, r, x in zip(groups, rows, inputs):
            T = int(self.data.lengths[idx].max())
            batch = Batch(
                x,
                torch.from_numpy(self.data.tokens[idx, :T].astype(np.int64)),
                torch.from_numpy(self.data.lengths[idx].astype(np.int64)),
                image_index=torch.from_numpy(np.searchsorted(r, self.data.rows[idx])),  # (B,) caption → image
            )
            if self.targets is not None:
                batch.boxes = Boxes(*map(torch.from_numpy, self.targets.for_captions(idx, T - 1)))
            yield batch.pin_memory() if pin else batch

    def features(self, rows: np.ndarray) -> torch.Tensor:
        """The fine-tuned encoder's features of rows (n, L, D), for validation."""
        return encoded_features(
            self.encoder, self.data, rows, cache=self.cache, device=self.device, workers=self.workers
        )


def input_cache(
    data: CaptionData,
    base: Encoder,
    start: int,
    process: distributed.Process,
    *,
    workers: int = 2,
    progress: bool = True,
) -> FeatureCache:
    """The frozen layers' output (VGG's pool4) for every image, cached beside the features; made if missing,
    resumably as `prepare` makes features, each torchrun process its share. Unreadable images are skipped here too."""
    d, device = process.dist, process.device
    n, (L, D) = len(data.meta["image_ids"]), layer_input_shape(data.encoder, start)
    info = input_cache_info(data, start)
    info_path = os.path.join(data.dir, f"{INPUT_CACHE}.json")
    if d.main:
        try:
            if os.path.exists(info_path):
                with open(info_path, encoding="utf-8") as f:
                    if json.load(f) != info:
                        raise CaptionerError(
                            f"{info_path}: the {INPUT_CACHE} cache there was made for other "
                            f"layers or images; delete {INPUT_CACHE}.* in {data.dir} to remake it"
                        )
            else:
                write_json_atomic(info_path, info)
            cache = FeatureCache(data.dir, n, L, D, mode="r+", name=INPUT_CACHE)
        except OSError as e:
            raise CaptionerError(
                f"{data.dir}: cannot write the {INPUT_CACHE} cache that {CACHED} fine-tuning "
                f"reads ({e.strerror}); make the data directory writable"
            ) from None
        unreadable = np.flatnonzero((data.cache.done == BAD) & (cache.done == TODO))
        cache.mark_bad(unreadable)
    distributed.barrier(d)
    cache = FeatureCache(data.dir, n, L, D, mode="r+", name=INPUT_CACHE)
    todo = cache.todo(d.rank, d.world)
    if len(todo):
        frozen = optimize_encoder(Encoder(base.features[:start]), device)  # same outputs, faster (prepare's)
        extract_features(
            cache,
            ImageFiles(data.meta["paths"], todo, data.encoder.preprocess),
            frozen,
            batch_size=64 if device.type == "cuda" else 8,
            workers=workers,
            device=str(device),
            progress=progress,
        )
    distributed.barrier(d)
    return cache


def add_tuned_familiarity(
    paths: list[str], data: CaptionData, checkpoints, device: torch.device, *, seed: int, workers: int = 2
) -> float:
    """Put into each fine-tuned checkpoint of `paths` (missing ones skipped) the familiarity statistics of the
    encoder it holds, since the feature cache holds the frozen encoder's output, not theirs; checkpoints of one step
    share one computation. Returns the seconds it took."""
    t0, done = time.monotonic(), {}
    for path in paths:
        if not os.path.exists(path):
            continue
        ck = load_checkpoint(path)
        state = ck["encoder_state"]
        if ck["step"] not in done:
            encoder = apply_encoder_state(build_encoder(data.encoder)[0], state, path).to(device).eval()
            read = checkpoint_features(encoder, state, data, device, path, workers)  # shares its layers
            served = optimize_encoder(encoder, device, image_size=data.encoder.image_size)  # as the captioner runs it
            stats = fit_stats(data, seed=seed, features=read, encoder=served)
            done[ck["step"]] = stats.to_dict() if stats is not None else None
        ck["familiarity"] = done[ck["step"]]
        checkpoints.write(ck, path)
    return time.monotonic() - t0
