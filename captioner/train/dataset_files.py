"""The files `prepare` writes once the features are done: vocabulary, encoded captions, splits, statistics.

vocab.json (the words of the training captions, at least min_count times), captions.npz (the
training captions as token ids: tokens (n, max_len + 2) int32, lengths (n,), their cache rows
(n,)), splits.json (the images of each split, the references of val and test, the images
dropped) and meta.json marked complete, with the per-channel mean and std of the features.
"""

from __future__ import annotations

import os
from collections import Counter

import numpy as np

from captioner.data.coco import SPLITS
from captioner.data.dataset import BAD, FeatureCache, nonfinite_rows
from captioner.errors import CaptionerError
from captioner.io import atomic_path, write_json_atomic
from captioner.models.vocab import Vocabulary, tokenize


def _feature_stats(cache: FeatureCache, rows: list[int], sample: int = 2000) -> tuple[list[float], list[float]]:
    """Per-channel mean and std of training features (over a fixed sample of images)."""
    pick = np.asarray(rows)[np.linspace(0, len(rows) - 1, min(sample, len(rows))).astype(int)]
    D = cache.shape[2]
    s1, s2, used = np.zeros(D), np.zeros(D), 0
    for i in range(0, len(pick), 256):
        f = cache[pick[i : i + 256]]  # (n, L, D) fp16
        f = f[~nonfinite_rows(f)].astype(np.float64).reshape(-1, D)  # (n'*L, D): damaged rows left out
        s1 += f.sum(0)
        s2 += (f * f).sum(0)
        used += len(f) // cache.shape[1]
    n = max(used, 1) * cache.shape[1]
    mean = s1 / n
    std = np.sqrt(np.maximum(s2 / n - mean**2, 0.0))
    return mean.round(6).tolist(), std.round(6).tolist()


def _vocabulary(usable: list, min_count: int) -> tuple[Counter, Vocabulary, list[str]]:
    """The training captions' word counts, the vocabulary they give, and the words below min_count."""
    # Words are counted in the training split only: val and test captions must not shape the model.
    counts = Counter(t for row, r in usable if r.split == "train" for c in r.captions for t in tokenize(c))
    vocab = Vocabulary.from_counts(counts, min_count=min_count)
    if len(vocab) <= 4:
        raise CaptionerError(
            f"the training captions give an empty vocabulary at --min-word-freq "
            f"{min_count}; lower it or add training data"
        )
    return counts, vocab, [w for w, c in counts.items() if c < min_count]


def _encode_captions(usable: list, vocab: Vocabulary, max_len: int) -> tuple[list, list, list, int]:
    """The training captions as padded token ids: (cache rows, tokens, lengths, how many were too long)."""
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
        raise CaptionerError(
            f"no training captions: the train split is empty or every caption is longer than --max-len {max_len}"
        )
    return rows, tokens, lengths, too_long


def write_dataset(cfg, meta, records, cache, skipped) -> dict:
    """Write vocab.json, captions.npz, splits.json and the completed meta.json (`meta` as prepare began it, with the
    features' statistics added) into `cfg.out`; return prepare's summary. Rows of `cache` marked BAD (unreadable
    images) are left out."""
    out_dir, min_count, max_len = cfg.out, cfg.min_count, cfg.max_len
    usable = [(row, r) for row, r in enumerate(records) if cache.done[row] != BAD]
    counts, vocab, rare = _vocabulary(usable, min_count)
    rows, tokens, lengths, too_long = _encode_captions(usable, vocab, max_len)
    with atomic_path(os.path.join(out_dir, "captions.npz")) as tmp:
        np.savez(
            tmp,
            tokens=np.asarray(tokens, np.int32),
            lengths=np.asarray(lengths, np.int32),
            rows=np.asarray(rows, np.int64),
        )
    images = {s: [[r.image_id, row] for row, r in usable if r.split == s] for s in SPLITS}
    references = {s: {str(r.image_id): r.captions for row, r in usable if r.split == s} for s in ("val", "test")}
    write_json_atomic(
        os.path.join(out_dir, "vocab.json"), {"words": vocab.words, "min_count": min_count, "max_len": max_len}
    )
    # Images whose features could not be extracted (unreadable, --skip-bad) are named per split, so
    # that evaluation can say what it did not score.
    dropped = {
        s: [r.image_id for row, r in enumerate(records) if r.split == s and cache.done[row] == BAD] for s in SPLITS
    }
    write_json_atomic(
        os.path.join(out_dir, "splits.json"), {"images": images, "references": references, "dropped": dropped}
    )
    mean, std = _feature_stats(cache, sorted(set(rows)))
    write_json_atomic(
        os.path.join(out_dir, "meta.json"), {**meta, "feature_mean": mean, "feature_std": std, "complete": True}
    )
    return {
        "images": {s: len(v) for s, v in images.items()},
        "train_captions": len(rows),
        "vocabulary": len(vocab),
        "min_word_freq": min_count,
        # distinct training words seen fewer than min_word_freq times, now <unk>, and their share of words
        "words_below_min_freq": len(rare),
        "unk_share": round(sum(counts[w] for w in rare) / max(1, sum(counts.values())), 5),
        "too_long": too_long,
        "bad_images": int((cache.done == BAD).sum()),
        "skipped": skipped.report(),
    }
