"""A prepared data directory, read back for training and evaluation.

Files written by `prepare` (see prepare.py):
    meta.json        encoder spec, image ids and paths in feature-row order, settings
    features.npy     (N, L, D) fp16, memory-mapped; features.done marks finished rows
    vocab.json       the vocabulary
    captions.npz     training captions: tokens (C, max_len+2) int32, lengths (C,), rows (C,)
    splits.json      split → [[image_id, row], ...] and split → {image_id: [raw references]}
Features stay on disk and are paged in per batch, so memory does not grow with the dataset.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from captioner.data.features import FeatureCache, damaged_row_message, nonfinite_rows
from captioner.errors import CaptionerError
from captioner.io import read_json
from captioner.models.encoder import EncoderSpec
from captioner.models.views import shifts
from captioner.models.vocab import Vocabulary

FORMAT = "captioner-data/1"
ROTATED = "features_rot180"  # the FeatureCache of the images' views (turned 180°, then moved: models.views)

log = logging.getLogger(__name__)


@dataclass
class Batch:
    """Training captions with their image features."""

    features: torch.Tensor  # (B, L, D) float32; when fine-tuning, the encoder's inputs, one per image (finetune.py)
    captions: torch.Tensor  # (B, T) long, <start> ... <end> <pad>...
    lengths: torch.Tensor  # (B,) long, counting <start> and <end>
    image_index: torch.Tensor | None = None  # (B,) long: each caption's row in `features` when fine-tuning
    dropped: tuple[int, ...] = ()  # feature rows of captions left out: their features are not finite
    # The images' views (models.views, for objectives.consistency), for a share of the captions:
    # turned_rows (k,) are their places in the batch, turned (k, L, D) their features, turned_moves
    # (k, 2) the cells each view was moved by after the turn.
    turned: torch.Tensor | None = None
    turned_rows: torch.Tensor | None = None
    turned_moves: torch.Tensor | None = None
    # Where the captions' object words should look (`fit --boxes`): (E,) places in the batch and
    # steps, (E, L) the objects' cells.
    box_rows: torch.Tensor | None = None
    box_steps: torch.Tensor | None = None
    box_masks: torch.Tensor | None = None
    box_images: torch.Tensor | None = None  # (B,) each caption's feature row, for the model's own captions

    def to(self, device, non_blocking: bool = False) -> Batch:
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Batch:
        return self._map(torch.Tensor.pin_memory)

    def _map(self, fn) -> Batch:
        """The batch with fn applied to each of its tensors."""
        tensors = (
            self.features,
            self.captions,
            self.lengths,
            self.image_index,
            self.turned,
            self.turned_rows,
            self.turned_moves,
            self.box_rows,
            self.box_steps,
            self.box_masks,
            self.box_images,
        )
        moved = [t if t is None else fn(t) for t in tensors]
        return Batch(*moved[:4], self.dropped, *moved[4:])

    def with_targets(self, targets, idx: np.ndarray) -> Batch:
        """The batch with the box targets of its captions `idx` (`data.boxes.BoxTargets`), if any."""
        if targets is None:
            return self
        self.box_images = torch.from_numpy(targets.rows[idx].astype(np.int64))
        found = targets.for_captions(idx)
        if found is not None:
            self.box_rows, self.box_steps, self.box_masks = (torch.from_numpy(x) for x in found)
        return self


class CaptionData:
    """Read-only view of a prepared data directory."""

    def __init__(self, data_dir: str):
        meta_path = os.path.join(data_dir, "meta.json")
        if not os.path.isfile(meta_path):
            raise CaptionerError(
                f"{data_dir}: not a prepared data directory (no meta.json); run `train.py prepare --out` to make one"
            )
        self.meta = read_json(meta_path, "data directory metadata")
        if self.meta.get("format") != FORMAT:
            raise CaptionerError(f"{meta_path}: format {self.meta.get('format')!r}, expected {FORMAT!r}")
        if not self.meta.get("complete"):
            raise CaptionerError(
                f"{data_dir}: `prepare` has not finished here; run it again to complete it (finished features are kept)"
            )
        self.dir = data_dir
        self.encoder = EncoderSpec.from_dict(self.meta["encoder"])
        self.vocab = Vocabulary(read_json(os.path.join(data_dir, "vocab.json"), "vocabulary")["words"])
        self.max_len = int(self.meta["max_len"])
        self.cache = FeatureCache(
            data_dir, len(self.meta["image_ids"]), self.meta["locations"], self.meta["feature_dim"], mode="r"
        )
        # The images' views (turned 180°, then moved by up to `view_shift` cells), for the attention's
        # consistency (older directories: None; their views are turned only).
        self.turned_share = 1.0
        self.view_shift = int(self.meta.get("view_shift", 0))
        self.box_targets = None  # data.boxes.BoxTargets, set by `fit --boxes`
        self.turned = (
            FeatureCache(
                data_dir,
                len(self.meta["image_ids"]),
                self.meta["locations"],
                self.meta["feature_dim"],
                mode="r",
                name=ROTATED,
            )
            if self.meta.get("rotated")
            else None
        )
        splits = read_json(os.path.join(data_dir, "splits.json"), "splits")
        self.images = {s: np.asarray(v, dtype=np.int64).reshape(-1, 2) for s, v in splits["images"].items()}
        self.references = {s: {int(k): v for k, v in refs.items()} for s, refs in splits["references"].items()}
        # image ids of each split left out at prepare time (features not extracted); {} for older directories
        self.dropped: dict[str, list[int]] = splits.get("dropped", {})
        with np.load(os.path.join(data_dir, "captions.npz")) as npz:
            self.tokens, self.lengths, self.rows = npz["tokens"], npz["lengths"], npz["rows"]
        self.damaged: set[int] = set()  # feature rows found holding inf or NaN, named once each

    def feature_stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-channel mean and std of the training features (D,), for the decoder's standardisation."""
        return (
            torch.tensor(self.meta["feature_mean"], dtype=torch.float32),
            torch.tensor(self.meta["feature_std"], dtype=torch.float32),
        )

    def path_of(self, row: int) -> str:
        return self.meta["paths"][row]

    def split_images(self, split: str) -> tuple[np.ndarray, np.ndarray]:
        """(image ids, feature rows) of a split."""
        if split not in self.images or len(self.images[split]) == 0:
            raise CaptionerError(f"{self.dir}: the {split!r} split is empty")
        ids_rows = self.images[split]
        return ids_rows[:, 0], ids_rows[:, 1]

    def features(self, rows) -> torch.Tensor:
        """Features of rows, as float32 (n, L, D), for captioning a split.

        A damaged row (inf or NaN: a bad sector, a broken copy) would make beam search return
        nothing; it is read as zeros instead, and its image is named once on stderr.
        """
        rows = np.atleast_1d(np.asarray(rows))
        raw = self.cache[rows]  # (n, L, D) fp16, a fresh array
        bad = nonfinite_rows(raw)  # (n,)
        if bad.any():
            raw[bad] = 0
            for row in sorted(set(rows[bad].tolist()) - self.damaged):
                self.damaged.add(row)
                log.warning(
                    damaged_row_message(
                        self.meta["image_ids"][row],
                        self.path_of(row),
                        row,
                        self.cache.path,
                        "it is captioned from zeros",
                    )
                )
        return torch.from_numpy(raw.astype(np.float32))

    def num_batches(self, batch_size: int, world: int = 1) -> int:
        return len(bucket_batches(self.lengths, batch_size, seed=0, epoch=0, world=world))

    def batches(
        self,
        batch_size: int,
        *,
        seed: int,
        epoch: int,
        start: int = 0,
        rank: int = 0,
        world: int = 1,
        pin: bool = False,
    ) -> Iterator[Batch]:
        """Training batches of one epoch, bucketed by length; `start` skips finished ones.

        Captions whose image's features hold inf or NaN (a damaged cache row) are left out of
        their batch and named in `Batch.dropped`, so that they never reach the model. When the
        turned images' features are read (`self.turned`), a share of each batch's captions
        (`self.turned_share`, drawn from (seed, epoch, batch) like the batches) get theirs.

        Args:
            pin: page-locked memory, for non-blocking copies to a GPU.


        Raises:
            CaptionerError: every caption of a batch has damaged features.
        """
        batches = bucket_batches(self.lengths, batch_size, seed=seed, epoch=epoch, rank=rank, world=world)
        for k, idx in enumerate(batches[start:], start):
            raw = self.cache[self.rows[idx]]  # (B, L, D) fp16
            bad = nonfinite_rows(raw)  # (B,)
            picked = turned = None
            if self.turned is not None:
                rs = np.random.RandomState([seed, epoch, k, rank])
                picked = np.sort(rs.permutation(len(idx))[: max(1, math.ceil(self.turned_share * len(idx)))])
                turned = self.turned[self.rows[idx[picked]]]  # (k, L, D) fp16
                bad[picked[nonfinite_rows(turned)]] = True
            dropped = tuple(int(r) for r in self.rows[idx][bad])
            if bad.all():
                raise CaptionerError(
                    f"{self.cache.path}: the features of every image in a batch hold inf or "
                    f"NaN (rows {sorted(set(dropped))[:10]}); the cache is damaged: run "
                    "`train.py prepare ... --recheck` to re-extract bad rows"
                )
            batch = Batch(
                torch.from_numpy(raw[~bad].astype(np.float32)),
                torch.from_numpy(self.tokens[idx[~bad], : int(self.lengths[idx[~bad]].max())].astype(np.int64)),
                torch.from_numpy(self.lengths[idx[~bad]].astype(np.int64)),
                dropped=dropped,
            )
            if picked is not None:
                good = ~bad[picked]
                if good.any():  # their places among the captions kept
                    batch.turned = torch.from_numpy(turned[good].astype(np.float32))
                    batch.turned_rows = torch.from_numpy((np.cumsum(~bad) - 1)[picked[good]].astype(np.int64))
                    batch.turned_moves = torch.from_numpy(shifts(self.rows[idx[picked[good]]], self.view_shift))
            batch.with_targets(self.box_targets, idx[~bad])
            yield batch.pin_memory() if pin else batch


@dataclass
class ImageBatch:
    """Training images: features and the feature row (image) of each, for its references."""

    features: torch.Tensor  # (B, L, D) float32
    rows: torch.Tensor  # (B,) long
    dropped: tuple[int, ...] = ()  # rows left out for non-finite features (none here: see `fit`)

    def to(self, device, non_blocking: bool = False) -> ImageBatch:
        return ImageBatch(self.features.to(device, non_blocking=non_blocking), self.rows.to(device), self.dropped)


class TrainingImages:
    """The training images of a data directory, batched like `CaptionData.batches`: the same
    (seed, epoch) gives the same batches, `start` skips finished ones, ranks share each batch."""

    def __init__(self, data: CaptionData):
        self.data = data
        self.rows = np.unique(data.rows)  # images with at least one training caption

    def _chunks(self, batch_size: int, seed: int, epoch: int, world: int) -> list[np.ndarray]:
        order = self.rows[np.random.RandomState([seed, epoch, 1]).permutation(len(self.rows))]
        size = batch_size * world
        # Every process must take the same number of steps: drop a last chunk too small to share.
        return [c for c in (order[i : i + size] for i in range(0, len(order), size)) if len(c) >= world]

    def num_batches(self, batch_size: int, world: int = 1) -> int:
        return len(self._chunks(batch_size, 0, 0, world))

    def batches(
        self,
        batch_size: int,
        *,
        seed: int,
        epoch: int,
        start: int = 0,
        rank: int = 0,
        world: int = 1,
        pin: bool = False,
    ) -> Iterator[ImageBatch]:
        for chunk in self._chunks(batch_size, seed, epoch, world)[start:]:
            rows = chunk[rank::world]
            batch = ImageBatch(self.data.features(rows), torch.from_numpy(rows.astype(np.int64)))
            yield ImageBatch(batch.features.pin_memory(), batch.rows) if pin else batch


def bucket_batches(
    lengths: np.ndarray, batch_size: int, *, seed: int, epoch: int, rank: int = 0, world: int = 1
) -> list[np.ndarray]:
    """Caption indices grouped into batches of similar length, in a shuffled order.

    The same (seed, epoch) gives the same batches, so a resumed run replays an epoch exactly.
    With world > 1, each global batch of batch_size * world captions is split across ranks.
    """
    rs = np.random.RandomState([seed, epoch])
    # Shuffle, then stable-sort by length: equal lengths end up in random order.
    order = rs.permutation(len(lengths))
    order = order[np.argsort(lengths[order], kind="stable")]
    size = batch_size * world
    chunks = [order[i : i + size] for i in range(0, len(order), size)]
    chunks = [chunks[i] for i in rs.permutation(len(chunks))]
    # Every process must take the same number of steps: drop a last chunk too small to share.
    return [c[rank::world] for c in chunks if len(c) >= world]
