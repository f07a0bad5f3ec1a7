"""A prepared data directory, read back for training and evaluation.

Files written by `prepare` (N images, L locations, D feature size, C captions):
    meta.json        encoder spec, image ids and paths in feature-row order, settings
    features.npy     (N, L, D) fp16, read row by row; features.done marks finished rows
    features_views.npy  the same for the images' views (`models.views`), for the consistency
    vocab.json       the vocabulary
    captions.npz     training captions: tokens (C, max_len+2) int32, lengths (C,), rows (C,)
    splits.json      split → [[image_id, row], ...] and split → {image_id: [raw references]}
Features stay on disk and are read per batch, so memory does not grow with the dataset.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import torch

from captioner.data.features import FeatureCache, damaged_row_message, nonfinite_rows
from captioner.errors import CaptionerError
from captioner.io import read_json
from captioner.models.encoder import EncoderSpec
from captioner.models.vocab import Vocabulary

FORMAT = "captioner-data/1"
# The FeatureCache of the images' views (turned 180°, then moved: models.views), by the meta.json key
# that says it is there: "views" now, "rotated" in directories of earlier versions.
VIEWS = {"views": "features_views", "rotated": "features_rot180"}

log = logging.getLogger(__name__)


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
        # consistency (None without them; in the oldest directories they are turned only).
        self.view_shift = int(self.meta.get("view_shift", 0))
        name = next((VIEWS[key] for key in VIEWS if self.meta.get(key)), None)
        shape = (len(self.meta["image_ids"]), self.meta["locations"], self.meta["feature_dim"])
        self.views = None if name is None else FeatureCache(data_dir, *shape, mode="r", name=name)
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
        """Features of rows, as float32 (n, L, D), for captioning a split. A damaged row (inf or NaN) would
        make beam search return nothing: it is read as zeros instead, and its image is named once."""
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
