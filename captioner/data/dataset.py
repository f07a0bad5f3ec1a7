"""A prepared data directory, read back for training and evaluation.

Files written by `prepare` (N images, L locations, D feature size, C captions):
    meta.json        encoder spec, image ids and paths in feature-row order, settings
    features.npy     (N, L, D) fp16, a plain .npy (`np.load(path, mmap_mode="r")` maps it)
    features.done    (N,) uint8: 0 to do, 1 written, 2 unreadable image (skipped)
    features_views.npy  the same for the images' views (`models.views`), for the consistency
    photo_features.npz  the calibration photograph's views, for the familiarity threshold (`train.familiarity`)
    vocab.json       the vocabulary
    captions.npz     training captions: tokens (C, max_len+2) int32, lengths (C,), rows (C,)
    splits.json      split → [[image_id, row], ...] and split → {image_id: [raw references]}
Features stay on disk and are read per batch, so memory does not grow with the dataset. Rows are read and written
with pread/pwrite, not a memory map: the page cache keeps what fits, and the process's own memory stays the size of
one batch (a memory map would count every page touched). A row is marked done only after its features are fsync'ed,
so a killed `prepare` leaves at worst rows that are redone, never a row marked done with half-written features.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import numpy as np
import torch
from tqdm import tqdm

from captioner.errors import CaptionerError
from captioner.io import atomic_path, describe_os_error, disk_error, read_json
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
        mean, std = (torch.tensor(self.meta[k], dtype=torch.float32) for k in ("feature_mean", "feature_std"))
        return mean, std

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
                image_id = self.meta["image_ids"][row]
                consequence = "it is captioned from zeros"
                log.warning(damaged_row_message(image_id, self.path_of(row), row, self.cache.path, consequence))
        return torch.from_numpy(raw.astype(np.float32))


TODO, DONE, BAD = 0, 1, 2
FP16_MAX = 65504.0


def _create_atomically(path: str, make) -> None:
    try:
        with atomic_path(path) as tmp:
            make(tmp)
    except OSError as e:
        raise disk_error(e, path, "the feature cache") from None


def nonfinite_rows(features: np.ndarray) -> np.ndarray:
    """Which of n feature rows hold an inf or NaN anywhere; (n, ...) → (n,) bool.

    On fp16 a bit test, cheaper than np.isfinite: inf and NaN are exactly the values whose five exponent
    bits are all set, so a row's largest magnitude bit pattern finds one in one integer pass.
    """
    n = len(features)
    if n == 0 or features.size == 0:
        return np.zeros(n, dtype=bool)
    flat = np.ascontiguousarray(features).reshape(n, -1)  # (n, L*D)
    if flat.dtype == np.float16:
        return (flat.view(np.uint16) & 0x7FFF).max(axis=1) >= 0x7C00
    return ~np.isfinite(flat).all(axis=1)


def damaged_row_message(image_id, path: str, row: int, cache_path: str, consequence: str) -> str:
    """One line naming a damaged feature row's image and how to re-extract it."""
    return (
        f"image {image_id} ({path}): its features (row {row} of {cache_path}) hold inf or NaN, so "
        f"{consequence}; re-extract them with `train.py prepare ... --recheck` (the same flags as before)"
    )


def _npy_layout(path: str) -> tuple[tuple[int, ...], np.dtype, int]:
    """(shape, dtype, byte offset of the data) of a .npy file, from its header."""
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read(f)
        if fortran:
            raise ValueError("Fortran-ordered arrays are not supported")
        return shape, dtype, f.tell()


class FeatureCache:
    """(N, L, D) fp16 features on disk with a per-row done mark."""

    def __init__(self, data_dir: str, n: int, locations: int, dim: int, mode: str = "r", name: str = "features"):
        self.path = os.path.join(data_dir, f"{name}.npy")
        self.done_path = os.path.join(data_dir, f"{name}.done")
        self.shape = (n, locations, dim)
        self.row_bytes = locations * dim * 2
        if mode == "r+":
            self._create_missing()
        try:
            shape, dtype, self.offset = _npy_layout(self.path)
            self.done = np.memmap(self.done_path, dtype=np.uint8, mode=mode, shape=(n,))
        except (OSError, ValueError) as e:
            raise CaptionerError(
                f"{data_dir}: the feature cache is missing or unreadable ({e}); "
                "run `train.py prepare` for this directory"
            ) from None
        if tuple(shape) != self.shape or dtype != np.float16:
            raise CaptionerError(
                f"{self.path}: holds {dtype} {tuple(shape)}, expected float16 {self.shape}; "
                "the cache was made for another image list"
            )
        self.fd = os.open(self.path, os.O_RDWR if mode == "r+" else os.O_RDONLY)

    def __del__(self):
        if getattr(self, "fd", None) is not None:
            os.close(self.fd)
            self.fd = None

    def _create_missing(self) -> None:
        if not os.path.exists(self.path):
            make = lambda tmp: np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float16, shape=self.shape).flush()
            _create_atomically(self.path, make)
        if not os.path.exists(self.done_path):
            _create_atomically(self.done_path, lambda tmp: np.zeros(self.shape[0], np.uint8).tofile(tmp))

    def todo(self, rank: int = 0, world: int = 1) -> np.ndarray:
        """Rows still to extract, this rank's share (row % world == rank)."""
        rows = np.flatnonzero(self.done == TODO)
        return rows[rows % world == rank]

    def write(self, rows: np.ndarray, feats: np.ndarray) -> None:
        """Store features for rows, fsync them, then mark the rows done. A failed write (e.g. no space left)
        raises `CaptionerError`, and none of these rows is marked done."""
        data = np.ascontiguousarray(np.clip(feats, -FP16_MAX, FP16_MAX).astype(np.float16))  # (n, L, D)
        try:
            for row, f in zip(rows, data):
                view, at = memoryview(f.tobytes()), self.offset + int(row) * self.row_bytes
                while view:  # a write may land in part (a disk filling up); the rest raises ENOSPC
                    n = os.pwrite(self.fd, view, at)
                    view, at = view[n:], at + n
            os.fsync(self.fd)
        except OSError as e:
            raise CaptionerError(
                f"cannot write features to {self.path}: {describe_os_error(e, self.path)}; rows "
                "finished so far are kept: free some space and run prepare again"
            ) from None
        self.done[rows] = DONE
        self.done.flush()

    def unallocated_bytes(self) -> int:
        """Bytes of features.npy not yet on disk: the file is sparse until its rows are written."""
        st = os.stat(self.path)
        return max(0, st.st_size - st.st_blocks * 512)

    def recheck(self, progress: bool = True, chunk: int = 256) -> np.ndarray:
        """Read every done row, mark those holding inf or NaN to do again; returns those rows."""
        rows = np.flatnonzero(self.done == DONE)
        damaged = []
        for i in tqdm(
            range(0, len(rows), chunk), desc="recheck", unit="chunk", disable=not progress, dynamic_ncols=True
        ):
            part = rows[i : i + chunk]
            damaged += part[nonfinite_rows(self[part])].tolist()
        if damaged:
            self.done[damaged] = TODO
            self.done.flush()
        return np.asarray(damaged, dtype=np.int64)

    def mark_bad(self, rows: Sequence[int]) -> None:
        self.done[list(rows)] = BAD
        self.done.flush()

    def __getitem__(self, rows) -> np.ndarray:
        """Features of the given rows, (n, L, D) fp16, read into a fresh array."""
        rows = np.atleast_1d(np.asarray(rows, dtype=np.int64))
        return self.read(rows, np.empty((len(rows), *self.shape[1:]), dtype=np.float16))

    def read(self, rows: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Features of `rows` read into `out`, a C-contiguous (n, L, D) fp16 array (e.g. page-locked memory)."""
        for i, row in enumerate(rows):
            got = os.preadv(self.fd, [out[i]], self.offset + int(row) * self.row_bytes)
            if got != self.row_bytes:
                raise CaptionerError(
                    f"{self.path}: row {row} is cut short ({got} of {self.row_bytes} bytes); "
                    "the file is truncated: run `prepare` again into a new directory"
                )
        return out
