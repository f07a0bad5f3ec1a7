"""`prepare`: COCO captions (or a Karpathy dataset file) + images → vocabulary, encoded captions and the feature cache.

Resumable: meta.json is written first and names the images and encoder; a second run with the
same inputs reuses every finished feature row, and a run with different inputs is refused
rather than mixing two caches. The directory counts as prepared only once meta.json says
"complete", after everything else is on disk. A stop (SIGTERM, Ctrl-C) ends it after the current
batch of features, with done marks only for rows on disk; `recheck` re-extracts damaged rows.
"""
from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Sequence

import numpy as np

from .coco import SPLITS, load_dataset, read_json
from .data import FORMAT, write_json_atomic
from .distributed import Dist, barrier
from .encoder import FEATURE_DIM, EncoderSpec, build_encoder
from .equivariance import ROTATED, HalfTurn
from .errors import CaptionerError
from .fast_encoder import optimize_encoder
from .faults import GracefulStop, check_free_space, describe_os_error, nonfinite_rows, stop_requested
from .features import BAD, DONE, TODO, FeatureCache, extract_features
from .karpathy import load_karpathy
from .vocab import Vocabulary, tokenize


def _check_resumable(out_dir: str, meta: dict) -> None:
    path = os.path.join(out_dir, "meta.json")
    if not os.path.exists(path):
        return
    old = read_json(path, "data directory metadata")
    for key in ("image_ids", "encoder", "locations", "feature_dim"):
        if old.get(key) != meta.get(key):
            raise CaptionerError(
                f"{out_dir} already holds features made for different {key.replace('_', ' ')}; "
                "pass a new --out (or delete that directory) to prepare this data")


def prepare(captions: Sequence[str] | None, image_dirs: Sequence[str], out_dir: str, *,
            splits: str | None = None, karpathy: str | None = None, encoder: EncoderSpec = EncoderSpec(),
            min_count: int = 5, max_len: int = 20, skip_missing: bool = False,
            skip_bad: bool = False, batch_size: int | None = None, workers: int = 2,
            device: str = "cpu", dist: Dist = Dist(), progress: bool = True, recheck: bool = False,
            stop: GracefulStop | None = None, rotated: bool = True) -> dict:
    """Build a data directory; returns a summary (counts per split, vocabulary size, skipped).

    Args:
        captions: COCO captions JSON files (None or empty with `karpathy`).
        image_dirs: where the images are.
        out_dir: the data directory to write (created; resumed if it holds the same work).
        splits: a Karpathy split file; without it, a deterministic 90/5/5 split.
        karpathy: instead of `captions` and `splits`, one Karpathy dataset file
            (dataset_coco.json, dataset_flickr8k.json, dataset_flickr30k.json).
        encoder: which encoder makes the features.
        min_count: words seen fewer times in the training split's captions become <unk>
            (`--min-word-freq`); val and test captions are never counted.
        max_len: training captions with more words are left out.
        batch_size: images per encoder forward; default 8 on CPU (larger batches run VGG slower
            there: 5.4 images/s at 32 against 7.2 at 4, measured on 2 cores), 64 on a GPU.
        dist: under torchrun, this process's place: each rank extracts its share of the rows.
        recheck: first read every finished feature row and re-extract those holding inf or NaN.
        stop: once requested (SIGTERM, SIGINT), end after the current batch of features; the
            summary then says {"stopped": signal name, ...} and a rerun goes on from there.
        rotated: also store the features of every image turned 180°, for the soft attention's
            equivariance term (equivariance.py); about doubles the encoder's time.
    """
    if batch_size is None:
        batch_size = 64 if str(device).startswith("cuda") else 8
    if karpathy:
        if captions or splits:
            raise CaptionerError("--karpathy reads captions and splits from its one file; "
                                 "do not pass --captions or --splits with it")
        records, skipped = load_karpathy(karpathy, image_dirs, skip_missing=skip_missing, skip_bad=skip_bad)
        sources = {"karpathy": os.path.abspath(karpathy)}
    else:
        records, skipped = load_dataset(captions, image_dirs, splits, skip_missing=skip_missing,
                                        skip_bad=skip_bad)
        sources = {"captions": [os.path.abspath(c) for c in captions],
                   "splits": os.path.abspath(splits) if splits else None}
    enc, spec = build_encoder(encoder)
    grid = spec.grid
    meta = {"format": FORMAT, "encoder": spec.to_dict(), "locations": grid * grid,
            "feature_dim": FEATURE_DIM, "max_len": max_len, "min_count": min_count,
            "image_ids": [r.image_id for r in records], "paths": [r.path for r in records],
            "sources": sources, "rotated": rotated}
    os.makedirs(out_dir, exist_ok=True)
    if dist.main:
        _check_resumable(out_dir, meta)
        write_json_atomic(os.path.join(out_dir, "meta.json"), {**meta, "complete": False})
        cache = FeatureCache(out_dir, len(records), grid * grid, FEATURE_DIM, mode="r+")  # create the files once
        if rotated:
            FeatureCache(out_dir, len(records), grid * grid, FEATURE_DIM, mode="r+", name=ROTATED)
        if recheck:
            _recheck(cache, meta, progress)
        # faults (issue 15): say up front when the features will not fit; a full disk then stops
        # prepare with a message, keeping every finished row.
        short = check_free_space(cache.path, cache.unallocated_bytes(), "the feature cache")
        if short:
            print(f"warning: {short}; prepare stops when the disk is full, keeping finished rows", file=sys.stderr)
    barrier(dist)
    cache = FeatureCache(out_dir, len(records), grid * grid, FEATURE_DIM, mode="r+")
    fast = optimize_encoder(enc, device, image_size=spec.image_size)  # same features as enc, faster
    caches = [(cache, fast)]
    if rotated:
        caches.append((FeatureCache(out_dir, len(records), grid * grid, FEATURE_DIM, mode="r+", name=ROTATED),
                       HalfTurn(fast)))
    for target, encoder_ in caches:
        extract_features(target, meta["paths"], encoder_, spec.preprocess, batch_size=batch_size, workers=workers,
                         device=device, skip_bad=skip_bad, rank=dist.rank, world=dist.world, progress=progress,
                         stop=stop)
        if stop_requested(stop) and len(target.todo(dist.rank, dist.world)):
            return {"stopped": stop.signal_name, "rank": dist.rank,
                    "features_done": int((target.done == DONE).sum()),
                    "features_to_do": int((target.done == TODO).sum()),
                    **({"cache": ROTATED} if target is not cache else {})}
    barrier(dist)  # every rank's rows are on disk before the dataset files are written
    if not dist.main:
        return {"rank": dist.rank}
    try:
        return _write_dataset(out_dir, meta, records, cache, min_count, max_len, skipped)
    except OSError as e:
        raise CaptionerError(f"cannot write the dataset files in {out_dir}: {describe_os_error(e, out_dir)}; "
                             "the features are kept: free some space and run prepare again") from None


def _recheck(cache: FeatureCache, meta: dict, progress: bool) -> None:
    """Mark finished feature rows that hold inf or NaN to be extracted again, naming their images."""
    damaged = cache.recheck(progress=progress)
    for row in damaged[:20]:
        print(f"recheck: image {meta['image_ids'][row]} ({meta['paths'][row]}): features held inf or NaN; "
              "extracting them again", file=sys.stderr)
    print(f"recheck: {len(damaged)} of {len(cache.done)} feature rows to extract again", file=sys.stderr)


def _feature_stats(cache: FeatureCache, rows: list[int], sample: int = 2000) -> tuple[list[float], list[float]]:
    """Per-channel mean and std of training features (over a fixed sample of images)."""
    pick = np.asarray(rows)[np.linspace(0, len(rows) - 1, min(sample, len(rows))).astype(int)]
    D = cache.shape[2]
    s1, s2, used = np.zeros(D), np.zeros(D), 0
    for i in range(0, len(pick), 256):
        f = cache[pick[i:i + 256]]                                      # (n, L, D) fp16
        f = f[~nonfinite_rows(f)].astype(np.float64).reshape(-1, D)      # (n'*L, D): damaged rows left out
        s1 += f.sum(0)
        s2 += (f * f).sum(0)
        used += len(f) // cache.shape[1]
    n = max(used, 1) * cache.shape[1]
    mean = s1 / n
    std = np.sqrt(np.maximum(s2 / n - mean ** 2, 0.0))
    return mean.round(6).tolist(), std.round(6).tolist()


def _write_dataset(out_dir, meta, records, cache, min_count, max_len, skipped) -> dict:
    usable = [(row, r) for row, r in enumerate(records) if cache.done[row] != BAD]
    # Words are counted in the training split only: val and test captions must not shape the model.
    counts = Counter(t for row, r in usable if r.split == "train" for c in r.captions for t in tokenize(c))
    vocab = Vocabulary.from_counts(counts, min_count=min_count)
    if len(vocab) <= 4:
        raise CaptionerError(f"the training captions give an empty vocabulary at --min-word-freq "
                             f"{min_count}; lower it or add training data")
    rare = [w for w, c in counts.items() if c < min_count]
    rows, tokens, lengths, too_long = [], [], [], 0
    for row, r in usable:
        if r.split != "train":
            continue
        for c in r.captions:
            words = tokenize(c)
            if not words:
                continue
            if len(words) > max_len:
                too_long += 1
                continue
            ids = vocab.encode(words)
            rows.append(row), lengths.append(len(ids))
            tokens.append(ids + [0] * (max_len + 2 - len(ids)))
    if not rows:
        raise CaptionerError("no training captions: the train split is empty or every caption is "
                             f"longer than --max-len {max_len}")
    np_path = os.path.join(out_dir, "captions.npz")
    tmp = f"{np_path}.tmp{os.getpid()}.npz"
    try:
        np.savez(tmp, tokens=np.asarray(tokens, np.int32), lengths=np.asarray(lengths, np.int32),
                 rows=np.asarray(rows, np.int64))
        os.replace(tmp, np_path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    images = {s: [[r.image_id, row] for row, r in usable if r.split == s] for s in SPLITS}
    references = {s: {str(r.image_id): r.captions for row, r in usable if r.split == s}
                  for s in ("val", "test")}
    write_json_atomic(os.path.join(out_dir, "vocab.json"),
                      {"words": vocab.words, "min_count": min_count, "max_len": max_len})
    write_json_atomic(os.path.join(out_dir, "splits.json"), {"images": images, "references": references})
    mean, std = _feature_stats(cache, sorted(set(rows)))
    write_json_atomic(os.path.join(out_dir, "meta.json"),
                      {**meta, "feature_mean": mean, "feature_std": std, "complete": True})
    return {"images": {s: len(v) for s, v in images.items()}, "train_captions": len(rows),
            "vocabulary": len(vocab), "min_word_freq": min_count,
            # distinct training words seen fewer than min_word_freq times, now <unk>, and their share of words
            "words_below_min_freq": len(rare),
            "unk_share": round(sum(counts[w] for w in rare) / max(1, sum(counts.values())), 5),
            "too_long": too_long, "bad_images": int((cache.done == BAD).sum()),
            "skipped": skipped.report()}
