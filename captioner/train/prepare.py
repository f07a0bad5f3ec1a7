"""`prepare`: COCO captions (or a Karpathy dataset file) + images → vocabulary, encoded captions and the feature cache.

Resumable: a rerun with the same inputs reuses every finished feature row, one with different inputs is refused
rather than mixing two caches. The directory counts as prepared only once meta.json says "complete".
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Annotated

import numpy as np
import torch

from captioner.data.coco import load_dataset
from captioner.data.dataset import DONE, FORMAT, TODO, VIEWS, FeatureCache
from captioner.data.extraction import ImageFiles, extract_features
from captioner.data.karpathy import load_karpathy
from captioner.errors import CaptionerError
from captioner.evaluation.familiarity import PHOTOS, save_photo_features
from captioner.io import check_free_space, describe_os_error, read_json, write_json_atomic
from captioner.models.encoder import EncoderSpec, build_encoder
from captioner.models.fast_encoder import optimize_encoder
from captioner.models.views import max_shift, shifts, view
from captioner.options import Device, check_device, check_positive, choose_device
from captioner.train.dataset_files import write_dataset
from captioner.train.distributed import Dist, barrier
from captioner.train.log import GracefulStop, stop_requested


def _check_resumable(out_dir: str, meta: dict) -> None:
    path = os.path.join(out_dir, "meta.json")
    if not os.path.exists(path):
        return
    old = read_json(path, "data directory metadata")
    for key in ("image_ids", "encoder", "locations", "feature_dim"):
        if old.get(key) != meta.get(key):
            raise CaptionerError(
                f"{out_dir} already holds features made for different {key.replace('_', ' ')}; "
                "pass a new --out (or delete that directory) to prepare this data"
            )
    if old.get("rotated") and meta.get("rotated") and old.get("view_shift", 0) != meta["view_shift"]:
        raise CaptionerError(
            f"{out_dir} holds views of the images made by an older version (turned, not moved); "
            "pass a new --out to prepare this data, or --no-views to leave them"
        )


log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrepareConfig:
    """What `prepare` reads and how it encodes; each field is also `prepare`'s option."""

    images: Annotated[list[str], "--images", "image directories, searched in order (e.g. train2014 val2014)"]
    out: Annotated[str, "the data directory to write (resumed if it holds the same work)"]
    captions: Annotated[
        list[str] | None, "COCO captions files (e.g. captions_train2014.json captions_val2014.json)"
    ] = None
    karpathy: Annotated[
        str | None,
        "instead of --captions/--splits: Karpathy's dataset_coco.json, "
        "dataset_flickr8k.json or dataset_flickr30k.json (captions and split in one file; images "
        "are DIR/filepath/filename or DIR/filename)",
    ] = None
    splits: Annotated[str | None, "Karpathy split file (dataset_coco.json); default: a deterministic 90/5/5 split"] = (
        None
    )
    encoder: EncoderSpec = field(default_factory=EncoderSpec)
    min_count: Annotated[
        int,
        "--min-word-freq",
        "--min-count",
        "words seen fewer times in the training split's captions become <unk> (val and test captions are not counted)",
    ] = 5
    max_len: Annotated[int, "longer training captions are left out"] = 20
    skip_missing: Annotated[bool, "go on without images whose file is missing"] = False
    skip_bad: Annotated[bool, "go on without malformed annotations and unreadable images"] = False
    batch_size: Annotated[int | None, "images per encoder batch (default: 8 on CPU, 64 on GPU)"] = None
    workers: Annotated[
        int | None, "DataLoader workers decoding images (default: 2 on a CPU; on a GPU, the cores, at most 8)"
    ] = None
    device: Device = "auto"
    recheck: Annotated[
        bool,
        "read every finished feature row first and extract again those holding inf or NaN (a damaged disk or copy)",
    ] = False
    views: Annotated[
        bool,
        "--no-views",
        "skip the features of the images' views, turned 180° and moved by a cell or two (the attention "
        "consistency's; without them the encoder runs half as long and attention trains without it)",
    ] = True

    def __post_init__(self):
        if self.karpathy and (self.captions or self.splits):
            raise CaptionerError(
                "--karpathy reads captions and splits from its one file; do not pass --captions or --splits with it"
            )
        if not (self.karpathy or self.captions):
            raise CaptionerError("one of --captions or --karpathy is required")
        check_positive(self, "min_count", "max_len", "batch_size")
        check_device(self.device)


def prepare(
    cfg: PrepareConfig, *, dist: Dist | None = None, progress: bool = True, stop: GracefulStop | None = None
) -> dict:
    """Build a data directory; returns a summary (counts per split, vocabulary size, skipped). Under torchrun (`dist`)
    each rank extracts its share; once `stop` is requested it ends after the current batch of features, the summary
    says {"stopped": signal name, ...}, and a rerun goes on from there."""
    dist = dist or Dist()
    device = choose_device(cfg.device, dist.local_rank)
    records, skipped, sources = _read_records(cfg)
    enc, spec = build_encoder(cfg.encoder)
    grid = spec.grid
    meta = _begin_meta(cfg, spec, records, sources)
    caches = _open_caches(cfg, meta, dist, progress)
    fast = optimize_encoder(enc, device, image_size=spec.image_size)  # same features as enc, faster
    views = [None, lambda images, rows: view(images, _moves(rows, meta["view_shift"], images.device), grid)]
    batch_size = cfg.batch_size or (64 if device.type == "cuda" else 8)
    workers = cfg.workers if cfg.workers is not None else (min(8, os.cpu_count() or 1) if device.type == "cuda" else 2)
    views = views[: len(caches)]
    for target, transform in zip(caches, views):
        extract_features(
            target,
            ImageFiles(meta["paths"], target.todo(dist.rank, dist.world), spec.preprocess),
            fast,
            transform=transform,
            batch_size=batch_size,
            workers=workers,
            device=str(device),
            skip_bad=cfg.skip_bad,
            progress=progress,
            stop=stop,
        )
        if stop_requested(stop) and len(target.todo(dist.rank, dist.world)):
            return _stopped(stop, dist, target, first=target is caches[0])
    barrier(dist)  # every rank's rows are on disk before the dataset files are written
    if not dist.main:
        return {"rank": dist.rank}
    try:
        if not os.path.exists(os.path.join(cfg.out, PHOTOS)):
            save_photo_features(cfg.out, fast, spec)
        return write_dataset(cfg, meta, records, caches[0], skipped)
    except OSError as e:
        raise CaptionerError(
            f"cannot write the dataset files in {cfg.out}: {describe_os_error(e, cfg.out)}; "
            "the features are kept: free some space and run prepare again"
        ) from None


def _begin_meta(cfg: PrepareConfig, spec: EncoderSpec, records: list, sources: dict) -> dict:
    """meta.json as prepare begins it: the images, the encoder and the settings that make the features."""
    return {
        "format": FORMAT,
        "encoder": spec.to_dict(),
        "locations": spec.grid * spec.grid,
        "feature_dim": spec.channels,
        "max_len": cfg.max_len,
        "min_count": cfg.min_count,
        "image_ids": [r.image_id for r in records],
        "paths": [r.path for r in records],
        "sources": sources,
        _views_key(cfg.out): cfg.views,
        "view_shift": max_shift(spec.grid) if cfg.views else 0,
    }


def _stopped(stop: GracefulStop, dist: Dist, target: FeatureCache, *, first: bool) -> dict:
    """The summary of a prepare stopped before `target` was filled: a rerun goes on from there."""
    return {
        "stopped": stop.signal_name,
        "rank": dist.rank,
        "features_done": int((target.done == DONE).sum()),
        "features_to_do": int((target.done == TODO).sum()),
        **({} if first else {"cache": os.path.basename(target.path)}),
    }


def _moves(rows: np.ndarray, most: int, device: torch.device) -> torch.Tensor:
    """The views' moves of cache rows (`models.views.shifts`), on the images' device without waiting for it."""
    moves = torch.from_numpy(shifts(rows, most))  # (n, 2)
    return moves.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else moves


def _views_key(out_dir: str) -> str:
    """meta.json's key for the views' features: "views", or "rotated" in a directory an earlier version began."""
    path = os.path.join(out_dir, "meta.json")
    return "rotated" if os.path.exists(path) and "rotated" in read_json(path, "data directory metadata") else "views"


def _read_records(cfg: PrepareConfig):
    """The images with their captions and splits, what was skipped, and where they came from."""
    if cfg.karpathy:
        records, skipped = load_karpathy(cfg.karpathy, cfg.images, skip_missing=cfg.skip_missing, skip_bad=cfg.skip_bad)
        return records, skipped, {"karpathy": os.path.abspath(cfg.karpathy)}
    records, skipped = load_dataset(
        cfg.captions, cfg.images, cfg.splits, skip_missing=cfg.skip_missing, skip_bad=cfg.skip_bad
    )
    return (
        records,
        skipped,
        {
            "captions": [os.path.abspath(c) for c in cfg.captions],
            "splits": os.path.abspath(cfg.splits) if cfg.splits else None,
        },
    )


def _open_caches(cfg: PrepareConfig, meta: dict, dist: Dist, progress: bool) -> list[FeatureCache]:
    """The feature caches to fill (the views' too, with cfg.views), created once by rank 0."""
    n, shape = len(meta["image_ids"]), (meta["locations"], meta["feature_dim"])
    names = ["features", VIEWS[_views_key(cfg.out)]][: 1 + cfg.views]
    os.makedirs(cfg.out, exist_ok=True)
    if dist.main:
        _check_resumable(cfg.out, meta)
        write_json_atomic(os.path.join(cfg.out, "meta.json"), {**meta, "complete": False})
        cache = [FeatureCache(cfg.out, n, *shape, mode="r+", name=name) for name in names][0]
        if cfg.recheck:
            _recheck(cache, meta, progress)
        # Say up front when the features will not fit; a full disk then stops prepare, keeping every finished row.
        short = check_free_space(cache.path, cache.unallocated_bytes(), "the feature cache")
        if short:
            log.warning(f"{short}; prepare stops when the disk is full, keeping finished rows")
    barrier(dist)
    return [FeatureCache(cfg.out, n, *shape, mode="r+", name=name) for name in names]


def _recheck(cache: FeatureCache, meta: dict, progress: bool) -> None:
    """Mark finished feature rows that hold inf or NaN to be extracted again, naming their images."""
    damaged = cache.recheck(progress=progress)
    for row in damaged[:20]:
        log.info(
            f"recheck: image {meta['image_ids'][row]} ({meta['paths'][row]}): features held inf or NaN; "
            "extracting them again"
        )
    log.info(f"recheck: {len(damaged)} of {len(cache.done)} feature rows to extract again")
