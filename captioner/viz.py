"""Attention heatmaps, drawn once here for the CLI, the web demo and the notebooks.

As in the paper's figures, each g×g map is smoothed with a Gaussian of half a grid cell and
upsampled to the image. The smoothing runs on a small grid (FINE pixels per cell, 56×56 for
14×14), which is then upsampled once, bilinearly, to whatever size is drawn: the cost follows
the grid, not the image, so a thumbnail costs what a thumbnail needs. `overlay` blends a map
over the image with a perceptual colour map whose opacity follows the attention, so the parts
the model did not look at stay as they are. `attention_figure` lays out the image, then one
panel per word with the word beneath it.
Symbols: n words, g grid side, H×W the drawn image.
"""
from __future__ import annotations

import functools
import io
from collections.abc import Sequence

import matplotlib
import numpy as np
import torch
import torch.nn.functional as F
from matplotlib.figure import Figure
from PIL import Image
from torchvision.transforms.functional import gaussian_blur

from .images import Preprocess

FINE = 4              # pixels per grid cell of the small grid the maps are smoothed on
SIGMA_CELLS = 0.5     # Gaussian σ in grid cells: half a cell, as the paper's figures look
CMAP = "inferno"      # perceptually uniform, dark to bright: brighter is more attention
OPACITY = 0.7         # opacity at a map's peak; it falls with the attention elsewhere


# helpers

def _as_maps(attention) -> torch.Tensor:
    a = torch.as_tensor(np.asarray(attention, dtype=np.float32))
    g = a.shape[-1]
    return a.reshape(-1, 1, a.shape[-2], g)                                   # (n, 1, g, g)


def smooth_maps(attention) -> torch.Tensor:
    """(n, g, g) maps → (n, 1, FINE·g, FINE·g): bilinear onto the small grid, then the Gaussian.

    Each cell covers FINE pixels there, so σ = FINE·SIGMA_CELLS pixels is half a cell, and the
    ±3σ kernel stays far smaller than the grid (13 of 56 pixels for 14×14).
    """
    a = _as_maps(attention)                                                   # (n, 1, g, g)
    gh, gw = a.shape[-2:]
    up = F.interpolate(a, size=(FINE * gh, FINE * gw), mode="bilinear", align_corners=False)
    sigma = FINE * SIGMA_CELLS
    k = int(2 * round(3 * sigma) + 1)
    return gaussian_blur(up, kernel_size=[k, k], sigma=[sigma, sigma])       # (n, 1, F·g, F·g)


def heatmaps(attention, size: tuple[int, int], box: tuple[float, float, float, float] | None = None,
             smooth: bool = True) -> np.ndarray:
    """Maps (n, g, g) → heat (n, H, W) for an image of size (W, H), each scaled to [0, 1].

    Args:
        attention: each word's α on the grid.
        size: (width, height) of the image as drawn.
        box: the image region the grid covers (left, top, right, bottom); default all of it.
        smooth: Gaussian smoothing of half a grid cell, as in the paper's figures.
    """
    W, H = size
    if len(attention) == 0:
        return np.zeros((0, H, W), dtype=np.float32)
    left, top, right, bottom = box or (0, 0, W, H)
    bw, bh = max(1, round(right - left)), max(1, round(bottom - top))
    small = smooth_maps(attention) if smooth else _as_maps(attention)       # (n, 1, h, w)
    up = F.interpolate(small, size=(bh, bw), mode="bilinear", align_corners=False)[:, 0]  # (n, bh, bw)
    canvas = np.zeros((up.shape[0], H, W), dtype=np.float32)                  # (n, H, W)
    x0, y0 = round(left), round(top)
    # Paste the box into the image frame, clipping where a centre crop lies inside it.
    sx0, sy0 = max(0, -x0), max(0, -y0)
    dx0, dy0 = max(0, x0), max(0, y0)
    w = min(bw - sx0, W - dx0)
    h = min(bh - sy0, H - dy0)
    canvas[:, dy0:dy0 + h, dx0:dx0 + w] = up[:, sy0:sy0 + h, sx0:sx0 + w].numpy()
    peak = canvas.reshape(len(canvas), -1).max(axis=1)                        # (n,)
    return canvas / np.where(peak > 0, peak, 1.0)[:, None, None]


def upsample(attention: np.ndarray, size: tuple[int, int], box: tuple[float, float, float, float] | None = None,
             smooth: bool = True) -> np.ndarray:
    """One (g, g) map → (H, W) for an image of size (W, H), scaled to [0, 1] (see `heatmaps`)."""
    return heatmaps(np.asarray(attention)[None], size, box, smooth)[0]


@functools.lru_cache(maxsize=8)
def _lut(cmap: str) -> np.ndarray:
    """The colour map as a (256, 3) float32 table in 0..255: one lookup per pixel, no float maths."""
    return (matplotlib.colormaps[cmap](np.linspace(0.0, 1.0, 256))[:, :3] * 255).astype(np.float32)


def overlay(image: Image.Image, heat: np.ndarray, opacity: float = OPACITY, cmap: str = CMAP) -> Image.Image:
    """Blend a [0, 1] heat map (H, W) over an RGB image; the colour's opacity is opacity × heat.

    Where the model did not look (heat near 0) the image shows as it is; at the peak the
    colour map's brightest colour covers it at `opacity`.
    """
    rgb = np.asarray(image.convert("RGB"), dtype=np.float32)                 # (H, W, 3)
    heat = np.clip(heat, 0.0, 1.0)
    colours = _lut(cmap)[(heat * 255 + 0.5).astype(np.uint8)]                # (H, W, 3)
    alpha = (float(opacity) * heat)[..., None]                                # (H, W, 1)
    out = rgb + alpha * (colours - rgb)
    return Image.fromarray(out.clip(0, 255).round().astype(np.uint8))


def fit_side(image: Image.Image, side: int) -> Image.Image:
    """The image scaled so that its longest side is `side` (up or down), aspect kept."""
    w, h = image.size
    scale = side / max(w, h)
    size = (max(1, round(w * scale)), max(1, round(h * scale)))
    return image if size == image.size else image.resize(size, Image.BILINEAR)


def word_overlays(image: Image.Image, attention: np.ndarray, *, preprocess: Preprocess | None = None,
                  opacity: float = OPACITY, cmap: str = CMAP, max_side: int | None = 512) -> list[Image.Image]:
    """One overlay per word for an image and its (n, g, g) attention, drawn at most max_side."""
    image = image.convert("RGB")
    if max_side and max(image.size) > max_side:
        image = fit_side(image, max_side)
    if len(attention) == 0:
        return []
    box = (preprocess or Preprocess()).grid_box(*image.size)
    return [overlay(image, heat, opacity, cmap) for heat in heatmaps(attention, image.size, box)]


def attention_figure(image: Image.Image, words: Sequence[str], attention: np.ndarray, *,
                     preprocess: Preprocess | None = None, opacity: float = OPACITY, cmap: str = CMAP,
                     columns: int = 5, locations: Sequence[tuple[int, int]] | None = None,
                     title: str | None = None, panel_side: int = 320) -> Figure:
    """The paper-style figure: the image, then each word's overlay with the word beneath.

    Args:
        locations: (row, col) grid cells chosen by hard attention, marked with a dot.
        panel_side: longest side of each panel's image in pixels (a panel is 240 at 100 dpi).
    """
    base = image.convert("RGB")
    if max(base.size) > panel_side:
        base = fit_side(base, panel_side)
    overlays = word_overlays(base, attention, preprocess=preprocess, opacity=opacity, cmap=cmap, max_side=None)
    panels = [(base, "(image)")] + list(zip(overlays, words))
    cols = min(columns, len(panels))
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
            ax.plot(box[0] + (c + 0.5) * cell_w, box[1] + (r + 0.5) * cell_h, "o", ms=6,
                    mfc="white", mec="black")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def figure_png(fig: Figure, dpi: int = 100) -> bytes:
    """Render a figure to PNG bytes."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    return buf.getvalue()
