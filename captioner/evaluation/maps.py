"""Attention maps read as pictures: smoothed, upsampled onto the image, and where they peak.

As in the paper's figures, each g×g map is smoothed with a Gaussian of half a grid cell and
upsampled to the image. The smoothing runs on a small grid (FINE pixels per cell), upsampled once
to whatever size is drawn: the cost follows the grid, not the image. The figures draw these maps
and the pointing metric takes their peak, so what is scored is what is shown.
Symbols: n words, g grid side, H×W the drawn image.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torchvision.transforms.functional import gaussian_blur

FINE = 4  # pixels per grid cell of the small grid the maps are smoothed on
SIGMA_CELLS = 0.5  # Gaussian σ in grid cells: half a cell, as the paper's figures look


def _as_maps(attention) -> torch.Tensor:
    a = torch.as_tensor(np.asarray(attention, dtype=np.float32))
    g = a.shape[-1]
    return a.reshape(-1, 1, a.shape[-2], g)  # (n, 1, g, g)


def smooth_maps(attention) -> torch.Tensor:
    """(n, g, g) maps → (n, 1, FINE·g, FINE·g): bilinear onto the small grid, then the Gaussian (σ in
    pixels of the small grid)."""
    a = _as_maps(attention)  # (n, 1, g, g)
    gh, gw = a.shape[-2:]
    up = F.interpolate(a, size=(FINE * gh, FINE * gw), mode="bilinear", align_corners=False)
    sigma = FINE * SIGMA_CELLS
    k = int(2 * round(3 * sigma) + 1)
    return gaussian_blur(up, kernel_size=[k, k], sigma=[sigma, sigma])  # (n, 1, F·g, F·g)


def heatmaps(
    attention, size: tuple[int, int], box: tuple[float, float, float, float] | None = None, smooth: bool = True
) -> np.ndarray:
    """Maps (n, g, g) → heat (n, H, W) for an image of size (W, H), each scaled to [0, 1]; `box` is the
    region (left, top, right, bottom) the grid covers, default all of it."""
    W, H = size
    if len(attention) == 0:
        return np.zeros((0, H, W), dtype=np.float32)
    left, top, right, bottom = box or (0, 0, W, H)
    bw, bh = max(1, round(right - left)), max(1, round(bottom - top))
    small = smooth_maps(attention) if smooth else _as_maps(attention)  # (n, 1, h, w)
    up = F.interpolate(small, size=(bh, bw), mode="bilinear", align_corners=False)[:, 0]  # (n, bh, bw)
    canvas = np.zeros((up.shape[0], H, W), dtype=np.float32)  # (n, H, W)
    x0, y0 = round(left), round(top)
    # Paste the box into the image frame, clipping where a centre crop lies inside it.
    sx0, sy0 = max(0, -x0), max(0, -y0)
    dx0, dy0 = max(0, x0), max(0, y0)
    w = min(bw - sx0, W - dx0)
    h = min(bh - sy0, H - dy0)
    canvas[:, dy0 : dy0 + h, dx0 : dx0 + w] = up[:, sy0 : sy0 + h, sx0 : sx0 + w].numpy()
    peak = canvas.reshape(len(canvas), -1).max(axis=1)  # (n,)
    return canvas / np.where(peak > 0, peak, 1.0)[:, None, None]


def upsample(
    attention: np.ndarray,
    size: tuple[int, int],
    box: tuple[float, float, float, float] | None = None,
    smooth: bool = True,
) -> np.ndarray:
    """One (g, g) map → (H, W) for an image of size (W, H), scaled to [0, 1] (see `heatmaps`)."""
    return heatmaps(np.asarray(attention)[None], size, box, smooth)[0]
