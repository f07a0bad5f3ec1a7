"""Training batches from a prepared data directory, in packed or fixed shapes.

The same (seed, epoch) gives the same batches, so a resumed run replays the rest of its epoch
exactly; under torchrun each rank takes its share of every global batch.

Packed batches are as long as their longest caption and hold only real captions (CPUs: no work on
padding). Fixed batches (`FixedShapes`) always hold `size` captions, rows of length 0 filling the
last batch and standing in for captions whose features are damaged, padded to one of a few
lengths, so that every step of a length bucket has the same shapes (GPUs: one compile per bucket).
Batches are made ahead on a thread of their own (`prefetched`), so that the step does not wait for them.
Symbols: B captions, k of them with views, T tokens, L locations, D feature size.
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, fields
from typing import NamedTuple

import numpy as np
import torch

from captioner.data.dataset import CaptionData, nonfinite_rows
from captioner.errors import CaptionerError
from captioner.models.views import shifts


@dataclass(frozen=True)
class FixedShapes:
    """Batches of `size` captions, padded to the first of `lengths` (tokens) that holds the longest."""

    size: int
    lengths: tuple[int, ...]

    @classmethod
    def for_data(cls, size: int, longest: int, step: int = 4) -> FixedShapes:
        """Lengths every `step` tokens up to `longest` (the data's longest caption with <start> and <end>)."""
        return cls(size, tuple(sorted({*range(2 * step, longest, step), longest})))

    def length(self, longest: int) -> int:
        return next((n for n in self.lengths if n >= longest), longest)


class Views(NamedTuple):
    """The images' views (for the consistency) of k of a batch's captions."""

    features: torch.Tensor  # (k, L, D) the views' features
    rows: torch.Tensor  # (k,) long: their captions' places in the batch
    moves: torch.Tensor  # (k, 2) the cells each view was moved by


class Boxes(NamedTuple):
    """Where a batch's words should look (`fit --boxes`)."""

    masks: torch.Tensor  # (B, T-1, L) bool: the cells of the objects each step's word names
    images: torch.Tensor  # (B,) long: each caption's feature row, for the model's own words


@dataclass
class Batch:
    """Training captions with their image features (all tensors; `words` and `dropped` known on the host)."""

    features: torch.Tensor  # (B, L, D) float32 (fp16 until `to`); when fine-tuning, the encoder's inputs, one per image
    captions: torch.Tensor  # (B, T) long, <start> ... <end> <pad>...
    lengths: torch.Tensor  # (B,) long, counting <start> and <end>; 0 for a padding row
    words: int = 0  # the predicted positions (words and <end>) of the batch: what its loss is divided by
    image_index: torch.Tensor | None = None  # (B,) long: each caption's row in `features` when fine-tuning
    dropped: tuple[int, ...] = ()  # feature rows of captions left out: their features are not finite
    views: Views | None = None  # the consistency's
    boxes: Boxes | None = None  # the attention correctness's
    count: torch.Tensor | None = None  # () float32, `words` as a tensor, which travels with the batch

    def __post_init__(self):
        if not self.words:
            self.words = int((self.lengths - 1).clamp_min(0).sum())
        if self.count is None:
            self.count = torch.tensor(float(self.words))

    def to(self, device, non_blocking: bool = False) -> Batch:
        """The batch on `device`; features kept in fp16 on the host (fixed shapes) become float32 there."""
        return self._map(lambda t: _widened(t.to(device, non_blocking=non_blocking)))

    def pin_memory(self) -> Batch:
        return self._map(torch.Tensor.pin_memory)

    def _map(self, fn) -> Batch:
        mapped = lambda v: fn(v) if torch.is_tensor(v) else type(v)(*map(fn, v)) if isinstance(v, (Views, Boxes)) else v
        return Batch(**{f.name: mapped(getattr(self, f.name)) for f in fields(self)})


def _widened(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype == torch.float16 else t


@dataclass
class ImageBatch:
    """Training images: features and the feature row (image) of each, for its references."""

    features: torch.Tensor  # (B, L, D) float32
    rows: torch.Tensor  # (B,) long
    dropped: tuple[int, ...] = ()  # rows left out for non-finite features (none here: see `fit`)
    count: torch.Tensor | None = None  # () float32: the images, what self-critical training divides by

    def __post_init__(self):
        if self.count is None:
            self.count = torch.tensor(float(len(self.rows)))

    @property
    def words(self) -> int:
        return len(self.rows)

    def to(self, device, non_blocking: bool = False) -> ImageBatch:
        return ImageBatch(
            *(t.to(device, non_blocking=non_blocking) for t in (self.features, self.rows)),
            self.dropped,
            self.count.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> ImageBatch:
        return ImageBatch(self.features.pin_memory(), self.rows, self.dropped, self.count.pin_memory())


def bucket_batches(
    lengths: np.ndarray, batch_size: int, *, seed: int, epoch: int, rank: int = 0, world: int = 1
) -> list[np.ndarray]:
    """Caption indices grouped into batches of similar length, in a shuffled order; with world > 1, each
    global batch of batch_size * world captions is split across ranks."""
    rs = np.random.RandomState([seed, epoch])
    # Shuffle, then stable-sort by length: equal lengths end up in random order.
    order = rs.permutation(len(lengths))
    order = order[np.argsort(lengths[order], kind="stable")]
    chunks = global_batches(order, batch_size, world)
    return rank_share([chunks[i] for i in rs.permutation(len(chunks))], rank, world)


def global_batches(order: np.ndarray, batch_size: int, world: int) -> list[np.ndarray]:
    """`order` cut into the global batches of `batch_size` per process that all `world` processes share."""
    return [order[i : i + batch_size * world] for i in range(0, len(order), batch_size * world)]


def rank_share(chunks: list[np.ndarray], rank: int, world: int) -> list[np.ndarray]:
    """Process `rank`'s share of each global batch. Every process must take the same number of
    steps: a last batch too small to share is dropped."""
    return [c[rank::world] for c in chunks if len(c) >= world]


class CaptionBatches:
    """The training captions of a data directory, bucketed by length, with their images' features.

    Captions whose image's features hold inf or NaN (a damaged cache row) never reach the model: packed
    batches leave them out, fixed ones make them padding rows; both name them in `Batch.dropped`.
    """

    def __init__(
        self,
        data: CaptionData,
        batch_size: int,
        *,
        view_share: float = 0.0,
        targets=None,
        fixed: FixedShapes | None = None,
    ):
        self.data, self.batch_size, self.targets, self.fixed = data, batch_size, targets, fixed
        self.view_share = view_share if data.views is not None else 0.0

    @property
    def shapes(self) -> str:
        return "packed" if self.fixed is None else "fixed"

    def num_batches(self, world: int = 1) -> int:
        return len(bucket_batches(self.data.lengths, self.batch_size, seed=0, epoch=0, world=world))

    def batches(
        self, *, seed: int, epoch: int, start: int = 0, rank: int = 0, world: int = 1, pin: bool = False
    ) -> Iterator[Batch]:
        """The batches of one epoch from the `start`-th on; `CaptionerError` if every caption of a batch has
        damaged features."""
        batches = bucket_batches(self.data.lengths, self.batch_size, seed=seed, epoch=epoch, rank=rank, world=world)
        for k, idx in enumerate(batches[start:], start):
            batch = self._batch(idx, np.random.RandomState([seed, epoch, k, rank]), pin)
            yield batch.pin_memory() if pin else batch  # fixed shapes' features are page-locked already

    def _batch(self, idx: np.ndarray, rs: np.random.RandomState, pin: bool = False) -> Batch:
        data = self.data
        if self.fixed is not None:  # read straight into the batch's padded (and page-locked) features
            features = torch.empty((self.fixed.size, *data.cache.shape[1:]), dtype=torch.float16, pin_memory=pin)
            raw = data.cache.read(data.rows[idx], features[: len(idx)].numpy())  # (n, L, D) fp16
        else:
            raw = data.cache[data.rows[idx]]  # (n, L, D) fp16
        bad = nonfinite_rows(raw)  # (n,)
        picked = views = None
        if self.view_share > 0:
            picked = np.sort(rs.permutation(len(idx))[: max(1, math.ceil(self.view_share * len(idx)))])
            views = data.views[data.rows[idx[picked]]]  # (k, L, D) fp16
            bad[picked[nonfinite_rows(views)]] = True
        dropped = tuple(int(r) for r in data.rows[idx][bad])
        if bad.all():
            raise CaptionerError(
                f"{data.cache.path}: the features of every image in a batch hold inf or NaN (rows "
                f"{sorted(set(dropped))[:10]}); the cache is damaged: run `train.py prepare ... --recheck` "
                "to re-extract bad rows"
            )
        if self.fixed is not None:
            return self._fixed(idx, features, bad, picked, views, dropped)
        keep = idx[~bad]
        batch = Batch(
            torch.from_numpy(raw[~bad].astype(np.float32)),
            torch.from_numpy(data.tokens[keep, : int(data.lengths[keep].max())].astype(np.int64)),
            torch.from_numpy(data.lengths[keep].astype(np.int64)),
            dropped=dropped,
        )
        if picked is not None and (~bad[picked]).any():  # the views of the captions kept, at their places
            good = picked[~bad[picked]]
            batch.views = Views(
                torch.from_numpy(views[~bad[picked]].astype(np.float32)),
                torch.from_numpy((np.cumsum(~bad) - 1)[good].astype(np.int64)),
                torch.from_numpy(shifts(data.rows[idx[good]], data.view_shift)),
            )
        return self._with_targets(batch, keep)

    def _fixed(self, idx, features, bad, picked, views, dropped) -> Batch:
        """`size` rows padded to a bucket's length; damaged and missing rows have length 0 and zero features.
        `features` stay in the cache's fp16 up to the device: half the bytes to copy, no host conversion."""
        data, B = self.data, self.fixed.size
        T = self.fixed.length(int(data.lengths[idx].max()))
        tokens, lengths = np.zeros((B, T), dtype=np.int64), np.zeros(B, dtype=np.int64)
        n, width = len(idx), data.tokens.shape[1]
        features[n:] = 0.0
        features[torch.from_numpy(np.flatnonzero(bad))] = 0.0
        tokens[:n, : min(T, width)][~bad] = data.tokens[idx[~bad], : min(T, width)]
        lengths[:n][~bad] = data.lengths[idx[~bad]]
        batch = Batch(features, torch.from_numpy(tokens), torch.from_numpy(lengths), dropped=dropped)
        if picked is not None:  # always k views, on real rows (repeated when fewer are left)
            good = np.flatnonzero(~bad[picked])
            take = good[np.arange(len(picked)) % len(good)] if len(good) else np.zeros(len(picked), dtype=np.int64)
            view = torch.from_numpy(views[take])  # (k, L, D) fp16
            view[~torch.isfinite(view).flatten(1).all(1)] = 0.0
            rows = picked[take].astype(np.int64)
            moves = shifts(data.rows[idx[rows]], data.view_shift)
            extra = max(1, math.ceil(self.view_share * B)) - len(rows)
            if extra > 0:  # a short last batch: as many views as any other, on padding rows (which add nothing)
                view = torch.cat([view, view.new_zeros((extra, *view.shape[1:]))])
                rows = np.concatenate([rows, n + np.arange(extra) % (B - n)])
                moves = np.concatenate([moves, np.zeros((extra, *moves.shape[1:]), dtype=moves.dtype)])
            batch.views = Views(view, torch.from_numpy(rows), torch.from_numpy(moves))
        padded = np.concatenate([idx, np.full(B - n, -1)])  # (B,) caption or -1
        return self._with_targets(batch, padded)

    def _with_targets(self, batch: Batch, idx: np.ndarray) -> Batch:
        if self.targets is not None:
            batch.boxes = Boxes(*map(torch.from_numpy, self.targets.for_captions(idx, batch.captions.size(1) - 1)))
        return batch


class TrainingImages:
    """The training images of a data directory, batched (and shared among ranks) like `CaptionBatches`."""

    def __init__(self, data: CaptionData, batch_size: int):
        self.data, self.batch_size = data, batch_size
        self.rows = np.unique(data.rows)  # images with at least one training caption

    def _shares(self, seed: int, epoch: int, rank: int, world: int) -> list[np.ndarray]:
        order = self.rows[np.random.RandomState([seed, epoch, 1]).permutation(len(self.rows))]
        return rank_share(global_batches(order, self.batch_size, world), rank, world)

    def num_batches(self, world: int = 1) -> int:
        return len(self._shares(0, 0, 0, world))

    def batches(
        self, *, seed: int, epoch: int, start: int = 0, rank: int = 0, world: int = 1, pin: bool = False
    ) -> Iterator[ImageBatch]:
        for rows in self._shares(seed, epoch, rank, world)[start:]:
            batch = ImageBatch(self.data.features(rows), torch.from_numpy(rows.astype(np.int64)))
            yield batch.pin_memory() if pin else batch


_DONE = object()


def prefetched(items: Iterable, depth: int = 2) -> Iterator:
    """`items` in their order, made up to `depth` ahead on a background thread; an exception raised while
    making one is raised here, where that item would have come. Closing the iterator early (a stop, the
    time budget) stops the thread after the item it is making."""
    ready: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(entry) -> bool:
        while not stop.is_set():
            try:
                ready.put(entry, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def make() -> None:
        try:
            for item in items:
                if not put((item, None)):
                    return
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
            put((_DONE, e))
            return
        put((_DONE, None))

    thread = threading.Thread(target=make, name="captioner-batches", daemon=True)
    thread.start()
    try:
        while True:
            item, error = ready.get()
            if error is not None:
                raise error
            if item is _DONE:
                return
            yield item
    finally:
        stop.set()
        thread.join()
