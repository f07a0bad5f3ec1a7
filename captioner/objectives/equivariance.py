"""Half-turn equivariance of soft attention: the fix for heatmaps that sit beside the object.

Why (issue 10, measured in the README's 'Soft attention on scenes made elsewhere'): a conv5 cell's
receptive field covers its neighbours, so the soft context can read an object from the cell
next to it. Trained on captions alone, soft attention settles on *a* cell that carries the word,
often one cell off the object in a direction that differs from run to run; on scenes it was
never tuned on it pointed at 0.43-0.48 where hard attention, whose sampled cell has to be the
object, pointed at 0.73.

The fix needs no boxes. `prepare` also stores the features of every image turned half a turn
(180°, `features_rot180.npy`); `fit` runs the soft pass on those too, with the same caption, and
adds λ Σ_t Σ_i (√α_ti − √(Rα')_ti)² per word, where R turns a map half a turn back; the sum
over i is 2H², twice the squared Hellinger distance with the usual ½ (0 for equal maps, at most
2). Attending "one cell above the object" becomes
"one cell below it" in the turned image, which the term penalises; attending the object itself
costs nothing. A half turn flips both axes, so one extra encoding covers offsets in any
direction; captions are not trained on the turned features, so words like "left" need no
rewriting.

On a row-major grid, turning a map half a turn is reversing its flattened locations, for any
grid shape.
"""

from __future__ import annotations

import torch
from torch import nn

SQRT_EPS = 1e-8


class HalfTurn(nn.Module):
    """An encoder that sees its (B, 3, H, W) inputs turned 180°: the features of the turned image."""

    def __init__(self, encoder: nn.Module):
        super().__init__()
        self.encoder = encoder

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.encoder(images.flip(-2, -1))


def half_turn(maps: torch.Tensor) -> torch.Tensor:
    """Maps (..., L) over a row-major grid, turned 180°."""
    return maps.flip(-1)


def equivariance_loss(alphas: torch.Tensor, rotated_alphas: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Σ over real steps of Σ_i (√α_ti − √(Rα')_ti)² = 2 H²(α_t, Rα'_t), per caption.

    Args:
        alphas: (B, T-1, L) the maps on the image.
        rotated_alphas: (B, T-1, L) the maps on the image turned half a turn, same caption.
        mask: (B, T-1) real steps.

    Returns:
        (B,) summed over each caption's real steps.
    """
    a = (alphas.float() + SQRT_EPS).sqrt()  # α underflows to 0 in float32 for peaked
    b = (half_turn(rotated_alphas.float()) + SQRT_EPS).sqrt()  # maps; √ at 0 has an infinite slope
    return (((a - b) ** 2).sum(-1) * mask).sum(-1)


def equivariance_term(
    decoder, alphas: torch.Tensor, rotated: torch.Tensor, captions: torch.Tensor, mask: torch.Tensor, words
) -> torch.Tensor:
    """λ's multiplicand per word: `equivariance_loss` of the maps α of `captions` against the maps
    of the same captions on their images turned 180° (a soft pass of `decoder` on `rotated`).

    Args:
        alphas: (B, T-1, L) the maps on the images; rotated: (B, L, D) the turned images' features;
        captions: (B, T); mask: (B, T-1) real steps; words: what to divide the batch total by.
    """
    turned = decoder.teacher_forced(rotated, captions)  # same captions, images turned 180°
    return equivariance_loss(alphas, turned.alphas, mask.float()).sum() / words
