"""What the notebooks compute: attention statistics, training logs, dataset summaries, tables.

The notebooks in `notebooks/` import these functions and only display the results; the
figures are drawn by `tools.lab.plots`.

Symbols in shape comments: n words of a caption, g side of the attention grid, L = g·g
locations, N captions.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from captioner.errors import CaptionerError
from captioner.models.vocab import tokenize
from captioner.serve.api import Caption
from tools.lab.recipes import SplitCaption

# attention statistics


def attention_entropy(attention: np.ndarray, *, normalize: bool = False) -> np.ndarray:
    """Entropy of each word's attention map: 0 looks at one cell, log L spreads evenly.

    Args:
        attention: (n, g, g) or (n, L) weights, each map summing to 1.
        normalize: divide by log L, so models with different grids compare on [0, 1].

    Returns:
        (n,) entropies in nats (or fractions of log L).
    """
    a = np.asarray(attention, dtype=np.float64)
    a = a.reshape(a.shape[0], int(np.prod(a.shape[1:])))  # (n, L), n may be 0
    a = a / np.maximum(a.sum(1, keepdims=True), 1e-12)  # fp16 checkpoints round the sums
    h = -(a * np.log(np.clip(a, 1e-12, None))).sum(1)  # (n,)
    return h / math.log(a.shape[1]) if normalize else h


def attention_peak(attention: np.ndarray) -> np.ndarray:
    """The largest weight of each word's map, (n,): the share of attention on the top cell."""
    a = np.asarray(attention, dtype=np.float64)
    return a.reshape(a.shape[0], int(np.prod(a.shape[1:]))).max(1, initial=0.0)  # (n,)


def attention_stats(captions: Iterable[Caption | SplitCaption]) -> dict[str, np.ndarray]:
    """Per-word sharpness over many captions: {"entropy": fraction of log L, "peak": top weight}."""
    captions = [getattr(c, "caption", c) for c in captions]
    maps = [c.attention for c in captions if len(c.words)]
    if not maps:
        return {"entropy": np.zeros(0), "peak": np.zeros(0)}
    return {
        "entropy": np.concatenate([attention_entropy(a, normalize=True) for a in maps]),
        "peak": np.concatenate([attention_peak(a) for a in maps]),
    }


# training logs


@dataclass
class TrainingLog:
    """A run's metrics.jsonl as arrays, each sorted by step.

    `train` holds step, epoch, lr, loss, nll... per logged step (self-critical runs: reward,
    baseline, entropy... too); `val` holds step, epoch, BLEU-4, CIDEr, lr per validation.
    `epoch` is step / batches per epoch: fractional where a time budget ended an epoch early.
    """

    path: str
    batches_per_epoch: int
    objective: str = "xe"  # "xe" cross-entropy or "scst" self-critical (from the start record)
    train: dict[str, np.ndarray] = field(default_factory=dict)
    val: dict[str, np.ndarray] = field(default_factory=dict)

    def per_epoch(self) -> dict[str, np.ndarray]:
        """One entry per validation: epoch, mean training loss (and its word NLL part) since the
        previous validation, BLEU-4, CIDEr and the learning rate then in use; for a self-critical
        run, the mean reward of the sampled captions instead of the word NLL."""
        steps, train_steps = self.val["step"], self.train.get("step", np.zeros(0))
        second = "reward" if self.objective == "scst" else "nll"
        out: dict[str, list] = {"loss": [], second: [], "lr": []}
        for k, s in enumerate(steps):
            lo = steps[k - 1] if k else -np.inf
            pick = (train_steps > lo) & (train_steps <= s)
            for key in ("loss", second):
                out[key].append(float(self.train[key][pick].mean()) if pick.any() and key in self.train else np.nan)
            out["lr"].append(float(self.train["lr"][pick][-1]) if pick.any() else np.nan)
        return {
            "epoch": self.val["epoch"],
            "loss": np.asarray(out["loss"]),
            second: np.asarray(out[second]),
            "BLEU-4": self.val["BLEU-4"],
            "CIDEr": self.val["CIDEr"],
            "lr": np.asarray(out["lr"]),
        }


def _columns(records: Mapping[int, dict], per_epoch: int) -> dict[str, np.ndarray]:
    rows = [records[s] for s in sorted(records)]
    keys = [
        k
        for k, v in rows[0].items()
        if isinstance(v, (int, float))
        and not isinstance(v, bool)
        and all(isinstance(r.get(k), (int, float)) for r in rows)
    ]
    cols = {k: np.asarray([r[k] for r in rows], dtype=np.float64) for k in keys}
    if per_epoch:
        cols["epoch"] = cols["step"] / per_epoch
    return cols


def read_training_log(path: str) -> TrainingLog:
    """Read a run's metrics.jsonl (or the run directory holding it).

    A resumed run repeats the steps after its last checkpoint: the later record of a step wins.
    A run killed mid-write may leave a partial last line: it is skipped.

    Raises:
        CaptionerError: no such log, a malformed line, or no validation yet.
    """
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    if not os.path.isfile(path):
        raise CaptionerError(f"{path}: no such training log (fit writes RUN_DIR/metrics.jsonl)")
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    per_epoch, objective, train, val = 0, "xe", {}, {}
    for k, line in enumerate(lines):
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            if k == len(lines) - 1:
                continue
            raise CaptionerError(f"{path}: line {k + 1} is not JSON") from None
        event = r.get("event")
        if event == "start":
            per_epoch = int(r.get("batches_per_epoch") or 0)
            objective = (r.get("train") or {}).get("objective", "xe")
        elif event in ("train", "val"):
            (train if event == "train" else val)[int(r["step"])] = r
    if not val:
        raise CaptionerError(f"{path}: no validation records yet (the first comes at the end of epoch 1)")
    return TrainingLog(
        path, per_epoch, objective, _columns(train, per_epoch) if train else {}, _columns(val, per_epoch)
    )


# datasets


def coco_tokens(coco) -> list[list[str]]:
    """Every caption of a pycocotools COCO captions object, tokenised as for training."""
    return [tokenize(a["caption"]) for a in coco.anns.values()]


def caption_lengths(tokens: Sequence[Sequence[str]]) -> np.ndarray:
    """Words per caption, (N,)."""
    return np.asarray([len(t) for t in tokens], dtype=np.int64)


def length_histogram(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(lengths 0..max, how many captions have each)."""
    counts = np.bincount(np.asarray(lengths, dtype=np.int64))
    return np.arange(len(counts)), counts


def vocabulary_coverage(
    tokens: Sequence[Sequence[str]], min_counts: Iterable[int] = range(1, 21)
) -> dict[str, np.ndarray]:
    """What a vocabulary built with each minimum count keeps (same rule as `Vocabulary.build`).

    Returns:
        {"min_count", "words": vocabulary size without the special tokens, "tokens": share of
         word occurrences in the vocabulary, "captions": share of captions with no <unk>}.
    """
    counts = Counter(w for t in tokens for w in t)
    freq = np.asarray(sorted(counts.values()), dtype=np.int64)  # (V,)
    total = max(int(freq.sum()), 1)
    # A caption has no <unk> when its rarest word is kept.
    rarest = np.asarray([min(counts[w] for w in t) for t in tokens if t], dtype=np.int64)  # (N,)
    ms = np.asarray(list(min_counts), dtype=np.int64)
    return {
        "min_count": ms,
        "words": np.asarray([(freq >= m).sum() for m in ms]),
        "tokens": np.asarray([freq[freq >= m].sum() / total for m in ms]),
        "captions": np.asarray([(rarest >= m).mean() if len(rarest) else 0.0 for m in ms]),
    }


def coco_examples(coco, image_dirs: str | Sequence[str], k: int = 6, seed: int = 0) -> list[tuple[str, list[str]]]:
    """k random captioned images of a COCO captions object: (image path, its captions)."""
    dirs = [image_dirs] if isinstance(image_dirs, str) else list(image_dirs)
    ids = sorted(i for i in coco.imgs if coco.imgToAnns.get(i))
    out = []
    for i in np.random.default_rng(seed).permutation(len(ids)):
        name = coco.imgs[ids[i]]["file_name"]
        found = [
            p
            for d in dirs
            for p in (os.path.join(d, name), os.path.join(d, os.path.basename(name)))
            if os.path.isfile(p)
        ]
        if found:
            out.append((found[0], [a["caption"].strip() for a in coco.imgToAnns[ids[i]]]))
        if len(out) == k:
            break
    return out


# tables


def format_table(columns: Mapping[str, Sequence], digits: int = 3) -> str:
    """Columns of equal length as a plain-text table (floats rounded, None as "-")."""

    def cell(v) -> str:
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return "-"
        if isinstance(v, (float, np.floating)):
            # Small values such as learning rates keep their significant digits; BLEU's 1e-78
            # (no 4-gram matched) is 0.
            return f"{v:.{digits}g}" if 1e-10 < abs(v) < 1e-2 else f"{v:.{digits}f}"
        return str(v)

    cols = {k: [cell(v) for v in vals] for k, vals in columns.items()}
    widths = {k: max([len(k)] + [len(v) for v in vals]) for k, vals in cols.items()}
    n = max((len(v) for v in cols.values()), default=0)
    lines = ["  ".join(k.rjust(widths[k]) for k in cols)]
    lines += [
        "  ".join(cols[k][i].rjust(widths[k]) if i < len(cols[k]) else " " * widths[k] for k in cols) for i in range(n)
    ]
    return "\n".join(lines)


def metrics_table(
    metrics: Mapping[str, Mapping],
    keys: Sequence[str] = ("BLEU-1", "BLEU-4", "ROUGE-L", "CIDEr", "pointing", "mean_length", "images"),
) -> str:
    """`evaluate` outputs of several models, one row each; chance pointing added when known."""
    columns: dict[str, list] = {"model": list(metrics)}
    for k in keys:
        columns[k] = [m.get(k) for m in metrics.values()]
    if any(m.get("grounding") for m in metrics.values()):
        columns["chance"] = [(m.get("grounding") or {}).get("chance") for m in metrics.values()]
    return format_table(columns)
