"""The second view of an image that the attention's consistency compares maps across.

The view is the image turned 180° and then moved by a few whole grid cells (dy down, dx right). The rows and columns it
uncovers repeat the image's edge next to them: a blank fill would draw an edge that looks like the encoder's zero
padding, which a map could follow. A map that rests on what a word names follows the content into the view; a map parked
on the grid, mirrored through its centre, or at a fixed offset from the object does not.

Each image's move comes from its row in the feature cache, so `prepare` and `fit` agree on it
without storing it. Shapes: N maps or images, L = G×G locations, S image side.
"""

from __future__ import annotations

import numpy as np
import torch


def max_shift(grid: int) -> int:
    """The largest move in cells: 2 on the 14×14 grid, 1 on small grids."""
    return max(1, round(grid / 7))


def shifts(rows: np.ndarray, most: int) -> np.ndarray:
    """(n, 2) moves (dy, dx) in cells for cache rows (n,), each in [-most, most], never (0, 0);
    `most` = 0 gives no move (data prepared with the turn alone)."""
    rows = np.asarray(rows, dtype=np.int64)
    if most == 0:
        return np.zeros((len(rows), 2), dtype=np.int64)
    side = 2 * most + 1
    k = (rows * 2654435761 % 2**32) >> 16  # a fixed scramble of the row number
    k = k % (side * side - 1)
    k = k + (k >= side * side // 2)  # skip the middle: (0, 0)
    return np.stack([k // side - most, k % side - most], axis=1)


def random_shifts(n: int, most: int, generator: torch.Generator | None = None, device=None) -> torch.Tensor:
    """(n, 2) moves drawn at random, never (0, 0), for views made during training."""
    side = 2 * most + 1
    k = torch.randint(side * side - 1, (n,), generator=generator, device=device)
    k = k + (k >= side * side // 2)
    return torch.stack([k // side - most, k % side - most], dim=1)


def view(x: torch.Tensor, moves: torch.Tensor | np.ndarray, grid: int) -> torch.Tensor:
    """Images or maps (N, C, S, S) → their views, moved by `moves` (N, 2) cells of S / grid pixels each.

    Pixel (y, x) of a view is pixel (y − dy·c, x − dx·c) of the turned image, clamped to its edge:
    two gathers on x's device, with no copy to the host."""
    x = x.flip(-2, -1)
    N, C, S, _ = x.shape
    moves = torch.as_tensor(moves, dtype=torch.int64, device=x.device).view(-1, 2) * (S // grid)  # (N, 2) pixels
    r = torch.arange(S, device=x.device)
    rows = (r - moves[:, :1]).clamp(0, S - 1)  # (N, S): the turned image's row of each view row
    cols = (r - moves[:, 1:]).clamp(0, S - 1)  # (N, S)
    x = x.gather(2, rows.view(N, 1, S, 1).expand(N, C, S, S))  # (N, C, S, S), rows moved
    return x.gather(3, cols.view(N, 1, 1, S).expand(N, C, S, S))  # (N, C, S, S), columns moved


def back_from_view(maps: torch.Tensor, moves: torch.Tensor, grid: int) -> torch.Tensor:
    """Maps (N, L) over the views' grids, brought back onto the images' grids (N, L): zero on the
    image's cells the move took out of the view."""
    G = grid
    r = torch.arange(G, device=maps.device)
    moves = moves.to(maps.device)
    rows = G - 1 - r + moves[:, :1]  # (N, G): the view's row of each image row
    cols = G - 1 - r + moves[:, 1:]  # (N, G)
    inside = ((rows >= 0) & (rows < G)).unsqueeze(2) & ((cols >= 0) & (cols < G)).unsqueeze(1)  # (N, G, G)
    index = (rows.clamp(0, G - 1).unsqueeze(2) * G + cols.clamp(0, G - 1).unsqueeze(1)).flatten(1)  # (N, L)
    return maps.gather(1, index) * inside.flatten(1)
