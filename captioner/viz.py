"""Attention heatmaps, drawn once here for the CLI, the web demo and the notebooks.

As in the paper's figures, each 14×14 map is upsampled to the image and smoothed with a
Gaussian, then blended over the image with a colour map. `attention_figure` lays out the
image, then one panel per word with the word beneath it.
"""
from __future__ import annotations

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


def upsample(attention: np.ndarray, size: tuple[int, int], box: tuple[float, float, float, float] | None = None,
             smooth: bool = True) -> np.ndarray:
    """A (g, g) map → (H, W) for an image of size (W, H), scaled to [0, 1].

    Args:
        attention: one word's α on the grid.
        size: (width, height) of the image.
        box: the image region the grid covers (left, top, right, bottom); default all of it.
        smooth: Gaussian smoothing of about one grid cell, as in the paper's figures.
    """
    W, H = size
    left, top, right, bottom = box or (0, 0, W, H)
    bw, bh = max(1, round(right - left)), max(1, round(bottom - top))
    a = torch.as_tensor(np.asarray(attention, dtype=np.float32))[None, None]  # (1, 1, g, g)
    up = F.interpolate(a, size=(bh, bw), mode="bilinear", align_corners=False)  # (1, 1, bh, bw)
    if smooth:
        sigma = max(bw, bh) / a.shape[-1] * 0.5        # half a cell
        # Odd kernel of ±3σ, but no wider than the map: the blur pads by reflection.
        k = min(int(2 * round(3 * sigma) + 1), 2 * min(bw, bh) - 1)
        if k >= 3:
            up = gaussian_blur(up, kernel_size=[k, k], sigma=[sigma, sigma])
    canvas = np.zeros((H, W), dtype=np.float32)
    x0, y0 = round(left), round(top)
    # Paste the box into the image frame, clipping where a centre crop lies inside it.
    sx0, sy0 = max(0, -x0), max(0, -y0)
    dx0, dy0 = max(0, x0), max(0, y0)
    w = min(bw - sx0, W - dx0)
    h = min(bh - sy0, H - dy0)
    canvas[dy0:dy0 + h, dx0:dx0 + w] = up[0, 0, sy0:sy0 + h, sx0:sx0 + w].numpy()
    peak = canvas.max()
    return canvas / peak if peak > 0 else canvas


def overlay(image: Image.Image, heat: np.ndarray, opacity: float = 0.6, cmap: str = "jet") -> Image.Image:
    """Blend a [0, 1] heat map (H, W) over an RGB image with a colour map."""
    rgb = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0        # (H, W, 3)
    colours = matplotlib.colormaps[cmap](heat)[..., :3]                      # (H, W, 3)
    out = (1.0 - opacity) * rgb + opacity * colours
    return Image.fromarray((out.clip(0, 1) * 255).round().astype(np.uint8))


def word_overlays(image: Image.Image, attention: np.ndarray, *, preprocess: Preprocess | None = None,
                  opacity: float = 0.6, cmap: str = "jet", max_side: int | None = 512) -> list[Image.Image]:
    """One overlay per word for an image and its (n, g, g) attention."""
    image = image.convert("RGB")
    if max_side and max(image.size) > max_side:
        image = image.copy()
        image.thumbnail((max_side, max_side))
    box = (preprocess or Preprocess()).grid_box(*image.size)
    return [overlay(image, upsample(a, image.size, box), opacity, cmap) for a in attention]


def attention_figure(image: Image.Image, words: Sequence[str], attention: np.ndarray, *,
                     preprocess: Preprocess | None = None, opacity: float = 0.6, cmap: str = "jet",
                     columns: int = 5, locations: Sequence[tuple[int, int]] | None = None,
                     title: str | None = None) -> Figure:
    """The paper-style figure: the image, then each word's overlay with the word beneath.

    Args:
        locations: (row, col) grid cells chosen by hard attention, marked with a dot.
    """
    overlays = word_overlays(image, attention, preprocess=preprocess, opacity=opacity, cmap=cmap)
    base = image.convert("RGB")
    if overlays:
        base = base.resize(overlays[0].size)
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
