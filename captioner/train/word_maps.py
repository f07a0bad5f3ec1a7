"""Where each word's evidence lies, learnt from the captions alone: word detectors over the cells, whose peaks
teach attention as boxes do (`fit --word-maps`).

One linear detector per content word scores every cell, p_iw = σ(u_w · a_i + c_w), on the standardised features.
An image holds w with the noisy-OR 1 − Π_i (1 − p_iw), trained on whether its captions say w (multiple-instance
learning, after Fang et al., CVPR 2015). A word teaches only where its detector is trusted: its best cell's score
ranks the validation images whose references say w above those that do not, with an AUC of `TRUSTED_AUC` or more.
In each training image whose captions say a trusted word, its target is the 3×3 cells around the map's smoothed
peak (the maps saturate, so a threshold would take cells mostly off the object; one cell alone leaves the decoder
too little of a hollow shape to read it). An untrusted word next to a trusted one in a caption borrows that word's
target (the outlined scenes' hollow shapes, whose colours are found and whose shapes are not). Why:
docs/attention.md#word-maps.

Symbols: N images, L cells, D feature channels, W words.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch

from captioner.data.boxes import BoxTargets
from captioner.data.dataset import CaptionData
from captioner.evaluation.grounding import peak
from captioner.models.decoder import FEATURE_STD_FLOOR
from captioner.models.vocab import tokenize

log = logging.getLogger(__name__)

CONTENT_SHARE = (0.01, 0.5)  # a content word is said in this share of the training images
TRUSTED_AUC = 0.8
READS = 30_000  # image reads the detectors train on: 30 epochs of 1,000 images, one of COCO's 113k
BATCH = 64


def said(rows: np.ndarray, captions, words: list[int]) -> np.ndarray:
    """(N, W) float: whether a caption of each image (feature row) holds each word; `captions` yields
    (feature row, word ids) pairs."""
    column = {w: k for k, w in enumerate(words)}
    at = {int(r): n for n, r in enumerate(rows)}
    labels = np.zeros((len(rows), len(words)), dtype=np.float32)
    for row, ids in captions:
        if int(row) in at:
            for t in ids:
                if int(t) in column:
                    labels[at[int(row)], column[int(t)]] = 1
    return labels


def training_captions(data: CaptionData):
    """(feature row, word ids) of each training caption, without its start and end tokens."""
    for row, tokens, length in zip(data.rows, data.tokens, data.lengths):
        yield row, tokens[1 : int(length) - 1]


def reference_captions(data: CaptionData, split: str):
    """(feature row, word ids) of each reference of a split's images."""
    for image_id, row in data.images[split]:
        for text in data.references[split].get(int(image_id), ()):
            yield row, data.vocab.encode(tokenize(text))


def noisy_or_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The images' binary cross-entropy on `labels` (B, W), each image holding w with P_w = 1 − Π_i (1 − p_iw),
    from the cells' logits (B, L, W)."""
    log_absent = torch.nn.functional.logsigmoid(-logits).sum(1)  # log(1 − P_w) = Σ_i log σ(−z_iw)
    log_present = torch.log(-torch.expm1(log_absent.clamp(max=-1e-6)))
    return -(labels * log_present + (1 - labels) * log_absent).mean()


class Standardised:
    """Feature rows read from the cache in batches, standardised as the decoder standardises them."""

    def __init__(self, data: CaptionData):
        self.data = data
        self.mean, std = data.feature_stats()
        self.std = std.clamp_min(FEATURE_STD_FLOOR)

    def __call__(self, rows: np.ndarray) -> torch.Tensor:
        return (self.data.features(rows) - self.mean) / self.std  # (n, L, D)


def fit_detectors(
    features: Standardised, rows: np.ndarray, labels: np.ndarray, *, reads: int = READS, seed: int = 0
) -> torch.nn.Linear:
    """Detectors (D → W) fitted with Adam by the noisy-OR on the captions' `labels` (N, W) of images `rows`."""
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        detectors = torch.nn.Linear(features.data.cache.shape[-1], labels.shape[1])
    optimizer = torch.optim.Adam(detectors.parameters(), lr=1e-3)
    target = torch.from_numpy(labels)
    for _ in range(max(1, math.ceil(reads / len(rows)))):
        for batch in torch.randperm(len(rows), generator=generator).split(BATCH):
            loss = noisy_or_loss(detectors(features(rows[batch.numpy()])), target[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return detectors


@torch.no_grad()
def maps(detectors: torch.nn.Linear, features: Standardised, rows: np.ndarray):
    """The detectors' maps p (n, L, W) on images `rows`, a batch at a time (COCO's maps of all its images
    would not fit in memory), each with its first image's index in `rows`."""
    for a in range(0, len(rows), BATCH):
        yield a, torch.sigmoid(detectors(features(rows[a : a + BATCH]))).numpy()


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """The chance that an image with the label scores above one without (ties half), from ranks; NaN without both."""
    positive = labels > 0
    n1, n0 = int(positive.sum()), int((~positive).sum())
    if not n1 or not n0:
        return math.nan
    _, tie, count = np.unique(scores, return_inverse=True, return_counts=True)
    ranks = (np.cumsum(count) - (count - 1) / 2)[tie]  # ties share their mean rank
    return float((ranks[positive].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def peak_cell(p: np.ndarray, grid: int) -> int:
    """The index of the cell that holds a map's (L,) smoothed peak."""
    fx, fy = peak(p.reshape(grid, grid))
    return min(int(fy * grid), grid - 1) * grid + min(int(fx * grid), grid - 1)


def around(cell: int, grid: int) -> np.ndarray:
    """The cells (L,) bool within one row and column of `cell`: 9, or fewer at the grid's edges."""
    row, col = divmod(cell, grid)
    near = np.zeros((grid, grid), dtype=bool)
    near[max(row - 1, 0) : row + 2, max(col - 1, 0) : col + 2] = True
    return near.reshape(-1)


def content_words(data: CaptionData, rows: np.ndarray) -> list[int]:
    """Vocabulary ids of the words said in `CONTENT_SHARE` of the training images `rows`."""
    keep = np.isin(data.rows, rows)
    tokens, lengths = data.tokens[keep].astype(np.int64), data.lengths[keep]
    steps = np.arange(tokens.shape[1])
    words = (steps >= 1) & (steps < lengths[:, None] - 1)  # (C, T) without the start and end tokens
    vocabulary = len(data.vocab)
    image_word = np.unique((data.rows[keep].astype(np.int64)[:, None] * vocabulary + tokens)[words])
    share = np.bincount(image_word % vocabulary, minlength=vocabulary) / len(rows)  # (V,)
    low, high = CONTENT_SHARE
    return [i for i, w in enumerate(data.vocab.words) if not w.startswith("<") and low <= share[i] <= high]


def word_map_targets(data: CaptionData, *, seed: int = 0, main: bool = True) -> BoxTargets:
    """`fit --word-maps`: the cells around the trusted words' peaks in the training images whose captions say them,
    and in the validation images whose references say them (`agreement`)."""
    if main and data.encoder.weights == "none":
        log.warning(
            "--word-maps on features of a random encoder (--encoder-weights none): its detectors tell whether an "
            "image holds a word far better than where, so the targets seldom lie on the object; prepare with a "
            "pretrained encoder (docs/attention.md#word-maps)"
        )
    _, rows = data.split_images("train")
    words = content_words(data, rows)
    features = Standardised(data)
    labels = said(rows, training_captions(data), words)
    detectors = fit_detectors(features, rows, labels, seed=seed)
    _, val_rows = data.split_images("val")
    val_labels = said(val_rows, reference_captions(data, "val"), words)
    val_best = np.concatenate([p.max(1) for _, p in maps(detectors, features, val_rows)])  # (N, W) best cells
    scores = [auc(val_best[:, k], val_labels[:, k]) for k in range(len(words))]
    trusted = [k for k, s in enumerate(scores) if s >= TRUSTED_AUC]
    grid = data.encoder.grid
    cells: dict[tuple[int, int], np.ndarray] = {}
    for images, says in ((rows, labels), (val_rows, val_labels)):
        for a, batch in maps(detectors, features, images):
            for n, p in enumerate(batch, start=a):
                for k in trusted:
                    if says[n, k]:
                        cells[int(images[n]), words[k]] = around(peak_cell(p[:, k], grid), grid)
    borrowed = borrowed_cells(data, cells, {words[k] for k in range(len(words)) if k not in trusted})
    cells.update(borrowed)
    if main:
        named = ", ".join(f"{data.vocab.words[words[k]]} {scores[k]:.2f}" for k in trusted) or "none"
        log.info(f"--word-maps: {len(trusted)} of {len(words)} content words teach where they lie (val AUC): {named}")
        log.info(f"--word-maps: {len({w for _, w in borrowed})} untrusted words look where a trusted neighbour does")
    return BoxTargets.of_cells(data, cells)


def borrowed_cells(data: CaptionData, cells: dict, untrusted: set[int]) -> dict[tuple[int, int], np.ndarray]:
    """Targets for the untrusted words: in a training caption, an untrusted word next to a trusted word that has a
    target in that image looks where the trusted word does ("a hollow red square": hollow and square look where
    red does), the union over the image's captions."""
    borrowed: dict[tuple[int, int], np.ndarray] = {}
    for row, ids in training_captions(data):
        for p, word in enumerate(int(w) for w in ids):
            if word in untrusted:
                for q in (p - 1, p + 1):
                    cell = cells.get((int(row), int(ids[q]))) if 0 <= q < len(ids) else None
                    if cell is not None:
                        key = (int(row), word)
                        borrowed[key] = cell | borrowed.get(key, False)
    return borrowed


def agreement(targets: BoxTargets, rows: dict[int, int], hyps: dict, grid: int) -> tuple[int, int]:
    """How many of the generated words that have a target in their image (`targets`, by feature row) peak there, and
    how many have one: validation's map agreement. `rows`: image id → feature row; `hyps`: image id → Hypothesis."""
    hits = words = 0
    for image_id, hyp in hyps.items():
        for step, word in enumerate(hyp.tokens):
            cells = targets.mask_of(rows[image_id], word)
            if cells is not None:
                words += 1
                hits += bool(cells[peak_cell(hyp.attention[step], grid)])
    return hits, words
