"""Attention heatmaps, drawn once here for everything that shows them (below training and serving alike).

Symbols: n words, g grid side, H×W the drawn image.
"""

from __future__ import annotations

import functools
import io
import textwrap
from collections.abc import Sequence

import matplotlib
import numpy as np
from matplotlib.figure import Figure
from PIL import Image

from captioner.evaluation.maps import heatmaps
from captioner.models.preprocess import Preprocess

CMAP = "inferno"  # perceptually uniform, dark to bright: brighter is more attention
OPACITY = 0.7  # opacity at a map's peak; it falls with the attention elsewhere


@functools.lru_cache(maxsize=8)
def _lut(cmap: str) -> np.ndarray:
    """The colour map as a (256, 3) float32 table in 0..255: one lookup per pixel, no float maths."""
    return (matplotlib.colormaps[cmap](np.linspace(0.0, 1.0, 256))[:, :3] * 255).astype(np.float32)


def overlay(image: Image.Image, heat: np.ndarray, opacity: float = OPACITY, cmap: str = CMAP) -> Image.Image:
    """Blend a [0, 1] heat map (H, W) over an RGB image; the colour's opacity is opacity × heat, so where
    the model did not look the image shows as it is."""
    rgb = np.asarray(image.convert("RGB"), dtype=np.float32)  # (H, W, 3)
    heat = np.clip(heat, 0.0, 1.0)
    colours = _lut(cmap)[(heat * 255 + 0.5).astype(np.uint8)]  # (H, W, 3)
    alpha = (float(opacity) * heat)[..., None]  # (H, W, 1)
    out = rgb + alpha * (colours - rgb)
    return Image.fromarray(out.clip(0, 255).round().astype(np.uint8))


def fit_side(image: Image.Image, side: int) -> Image.Image:
    """The image scaled so that its longest side is `side` (up or down), aspect kept."""
    w, h = image.size
    scale = side / max(w, h)
    size = (max(1, round(w * scale)), max(1, round(h * scale)))
    return image if size == image.size else image.resize(size, Image.BILINEAR)


def word_overlays(
    image: Image.Image,
    attention: np.ndarray,
    *,
    preprocess: Preprocess | None = None,
    opacity: float = OPACITY,
    cmap: str = CMAP,
    max_side: int | None = 512,
) -> list[Image.Image]:
    """One overlay per word for an image and its (n, g, g) attention, drawn at most max_side."""
    image = image.convert("RGB")
    if max_side and max(image.size) > max_side:
        image = fit_side(image, max_side)
    if len(attention) == 0:
        return []
    box = (preprocess or Preprocess()).grid_box(*image.size)
    return [overlay(image, heat, opacity, cmap) for heat in heatmaps(attention, image.size, box)]


def attention_figure(
    image: Image.Image,
    words: Sequence[str],
    attention: np.ndarray,
    *,
    preprocess: Preprocess | None = None,
    opacity: float = OPACITY,
    locations: Sequence[tuple[int, int]] | None = None,
    title: str | None = None,
    panel_side: int = 320,
    warning: str | None = None,
) -> Figure:
    """The paper-style figure: the image, then each word's overlay with the word beneath. `locations` are
    hard attention's (row, col) cells, marked with a dot; `panel_side` is each panel image's longest side in
    pixels; `warning` is shown in red under the title."""
    base = image.convert("RGB")
    if max(base.size) > panel_side:
        base = fit_side(base, panel_side)
    overlays = word_overlays(base, attention, preprocess=preprocess, opacity=opacity, max_side=None)
    panels = [(base, "(image)")] + list(zip(overlays, words))
    cols = min(5, len(panels))  # panels a row
    rows = -(-len(panels) // cols)
    # A Figure of its own, not pyplot's global state: safe to draw from several threads (the app).
    fig = Figure(figsize=(2.4 * cols, 2.6 * rows))
    axes = fig.subplots(rows, cols, squeeze=False)
    grid = attention.shape[-1] if len(attention) else 14
    box = (preprocess or Preprocess()).grid_box(*base.size)
    for ax in axes.flat:
        ax.axis("off")
    for k, (ax, (img, word)) in enumerate(zip(axes.flat, panels)):
        ax.imshow(img)
        ax.text(0.5, -0.04, word, transform=ax.transAxes, ha="center", va="top", fontsize=11)
        if locations is not None and k > 0:
            r, c = locations[k - 1]
            cell_w, cell_h = (box[2] - box[0]) / grid, (box[3] - box[1]) / grid
            ax.plot(box[0] + (c + 0.5) * cell_w, box[1] + (r + 0.5) * cell_h, "o", ms=6, mfc="white", mec="black")
    if title or warning:
        fig.suptitle(title or "")
    fig.tight_layout(rect=(0, 0, 1, 0.93) if warning else None)
    if warning:
        fig.text(
            0.5, 0.935, "\n".join(textwrap.wrap(warning, 40 * cols)), ha="center", va="top", color="#b91c1c", fontsize=9
        )
    return fig


def figure_png(fig: Figure, dpi: int = 100) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    return buf.getvalue()
