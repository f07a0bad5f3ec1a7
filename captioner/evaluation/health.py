"""Attention health: figures that tell meaningful maps from collapsed or parked ones, with no boxes.

A soft-attention model can write good captions while its maps say nothing: attention rests on one
cell (often on the grid's border, where the encoder's zero padding makes the features stand out),
whatever the word. These figures catch that from the maps alone:

- entropy: the mean entropy of the maps, as a fraction of log L (0: one cell, 1: spread evenly);
- stay: per caption, the share of its words whose peak cell is the caption's most common one,
  averaged over captions;
- border: the share of peaks on the grid's outer ring, over that ring's share of the cells (about 1
  for peaks spread evenly);
- top5: the share of all peaks on the five cells most often peaked at, over all images.

Symbols: n words of a caption, g grid side, L = g·g locations.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable

import numpy as np

# Where the figures say the maps are not meaningful, set from models scored against object boxes (docs/attention.md has
# the runs): pointing fell as the border ratio rose, as more peaks crowded onto a few cells, and with maps spread almost
# evenly. "stay" is reported but never warned on: models that point well stay on one object in one-object scenes. A
# sharp map is not a failure: the view consistency trains maps onto a cell or two of the object, and parking on one
# place is what top5 and border catch.
LIMITS = {"top5": 0.25, "border": 1.2, "entropy_high": 0.88}


def _maps(attention: np.ndarray) -> np.ndarray:
    a = np.asarray(attention, dtype=np.float64)
    return a.reshape(a.shape[0], -1) if a.size else np.zeros((0, 1))  # (n, L)


def attention_health(captions: Iterable[np.ndarray]) -> dict:
    """Health figures of many captions' maps, one (n, g, g) or (n, L) array per caption; None without
    words."""
    entropies, stays, peaks = [], [], []
    L = None
    for attention in captions:
        a = _maps(attention)
        if len(a) == 0:
            continue
        L = a.shape[1]
        a = a / np.maximum(a.sum(1, keepdims=True), 1e-12)  # fp16 maps round their sums
        entropies.append(-(a * np.log(np.clip(a, 1e-12, None))).sum(1) / math.log(L))  # (n,)
        top = a.argmax(1)  # (n,) peak cell per word
        stays.append(Counter(top.tolist()).most_common(1)[0][1] / len(top))
        peaks.append(top)
    if not peaks:
        return {"entropy": None, "stay": None, "border": None, "top5": None, "words": 0, "captions": 0}
    g = int(round(math.sqrt(L)))
    cells = np.concatenate(peaks)  # (words,)
    row, col = cells // g, cells % g
    on_border = (row == 0) | (row == g - 1) | (col == 0) | (col == g - 1)
    border_share = (4 * g - 4) / (g * g) if g > 1 else 1.0
    counts = np.bincount(cells, minlength=L)
    return {
        "entropy": float(np.concatenate(entropies).mean()),
        "stay": float(np.mean(stays)),
        "border": float(on_border.mean() / border_share),
        "top5": float(np.sort(counts)[::-1][:5].sum() / len(cells)),
        "words": int(len(cells)),
        "captions": len(peaks),
    }


def problems(health: dict) -> list[str]:
    """What the figures say is wrong with the maps, one sentence each (empty when healthy)."""
    if not health.get("words"):
        return []
    out = []
    if health["top5"] >= LIMITS["top5"]:
        out.append(f"{health['top5']:.0%} of all peaks fall on the same five cells, whatever the image")
    if health["border"] >= LIMITS["border"]:
        out.append(f"peaks fall on the grid's border {health['border']:.1f}x as often as its area would give")
    if health["entropy"] >= LIMITS["entropy_high"]:
        out.append("the maps are spread almost evenly over the image")
    return out


def advice(*, boxes: bool) -> str:
    """What to try when the health check flags a run's maps; `boxes`: the run had `fit --boxes`."""
    return (
        "the heatmaps may not show what the model names. Check that `prepare` stored the images' views "
        "(its default: the attention consistency needs them) and that --consistency is on; "
        + ("" if boxes else "with object boxes, `fit --boxes` teaches attention where the objects are; ")
        + "maps spread evenly: lower --alpha-c; see docs/attention.md"
    )


def summary(health: dict) -> str:
    """One line for logs and model cards."""
    if not health.get("words"):
        return "attention health: no words to judge"
    figures = (
        f"entropy {health['entropy']:.2f}, stay {health['stay']:.2f}, border {health['border']:.2f}x, "
        f"top-5 cells {health['top5']:.2f}"
    )
    found = problems(health)
    return f"attention health: {figures}" + (f" - NOT MEANINGFUL: {'; '.join(found)}" if found else " - ok")


def verdict(health: dict | None) -> dict | None:
    """Whether maps are meaningful, as checkpoints record it: {"meaningful", "problems", "health"};
    None without figures (no validation yet)."""
    if not health or not health.get("words"):
        return None
    found = problems(health)
    return {"meaningful": not found, "problems": found, "health": health}
