"""The feature cache: encoder outputs for every image, fp16, on disk, resumable.

Layout in the data directory:
    features.npy    (N, L, D) float16, a plain .npy (`np.load(path, mmap_mode="r")` maps it),
                    rows in the order of meta.json's images
    features.done   (N,) uint8: 0 to do, 1 written, 2 unreadable image (skipped)
Rows are read and written with positioned reads and writes (pread/pwrite), not a memory map:
the operating system's page cache keeps what fits, and the process's own memory stays the
size of one batch whatever the size of the cache (a memory map would count every page
touched). A row is marked done only after its features are fsync'ed, so a killed `prepare`
leaves at worst rows that are redone, never a row marked done with half-written features;
a failed write (a full disk) marks nothing. Both files are created under a temporary name and
renamed, so they exist whole or not at all. `recheck` finds done rows whose features hold
inf or NaN (a damaged disk or copy) and marks them to do again. `captioner.data.extraction` fills
the cache with an encoder's outputs.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
from tqdm import tqdm

from captioner.errors import CaptionerError
from captioner.io import atomic_path, describe_os_error, disk_error

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

    On fp16 a bit test: inf and NaN are exactly the values whose five exponent bits are all set,
    so the largest magnitude bit pattern of a row finds one in one integer pass, several times
    cheaper than np.isfinite.
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
        # name: "features" (the encoder's output), or fine-tuning's input cache beside it (`encoder_inputs.INPUT_CACHE`)
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

            def make(tmp):
                np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float16, shape=self.shape).flush()

            _create_atomically(self.path, make)
        if not os.path.exists(self.done_path):
            _create_atomically(self.done_path, lambda tmp: np.zeros(self.shape[0], np.uint8).tofile(tmp))

    def todo(self, rank: int = 0, world: int = 1) -> np.ndarray:
        """Rows still to extract, this rank's share (row % world == rank)."""
        rows = np.flatnonzero(self.done == TODO)
        return rows[rows % world == rank]

    def write(self, rows: np.ndarray, feats: np.ndarray) -> None:
        """Store features for rows, fsync them, then mark the rows done.

        Raises:
            CaptionerError: a write failed (e.g. no space left); none of these rows is marked done.
        """
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
