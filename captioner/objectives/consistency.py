"""View consistency: attention that looks at the objects themselves, learnt without boxes.

Trained on captions alone, attention need not look at what a word names: the LSTM's initial
state already summarises the image, so a map may rest on the grid's border, spread evenly, or
sit a cell beside the object (a conv5 cell sees its neighbours). This term asks each map to be
found again in a second view of the image, and to be sharp:

    C_t = ½ [ CE(α_t, V⁻¹α'_t) + CE(V⁻¹α'_t, α_t) ],   CE(p, q) = −Σ_i p_i log q_i,

where α_t is the map on the image, α'_t the map the same state h_{t−1} gives on the view, V⁻¹
brings a map on the view back onto the image's cells; both are compared over the cells the two
share and one more outcome, "elsewhere" (the image's cells moved out of the view, the view's
uncovered cells), so that no mass escapes the comparison. The view (`models.views`) is the image turned
180° and moved by one or two whole cells, a move drawn per image; `prepare` stores its features.

A cross-entropy is smallest when both maps are the same single cell, so the only maps that make
it small are sharp ones that follow the content. Each failure pays: a map parked on the grid
stays where it is when the content turns; an offset from the object flips sides; an even map
costs log of its spread. The move matters too: under a turn alone, a map on the cell mirrored
through the grid's centre, or on whichever of two mirrored corners is on the object's side,
follows the turn as well as the object does, and models trained that way found those maps. The
move shifts the centre of the turn by a different amount per image, which only a map anchored
on the content follows. Captions are not trained on the views, so "left" and "right" need no
rewriting.

The term is estimated on a share of each batch's captions (the loader reads the views' features
of those only: `CaptionData.turned_share`), at one random real step each, and scaled to the
batch's words, so its cost stays small: one attention map per picked caption (no second LSTM
pass) and the projection of those captions' views.

Symbols: B captions, T steps, L locations, D feature size, A attention size, H LSTM size, N
picked (caption, step) pairs.
"""

from __future__ import annotations

import math

import torch

from captioner.models.decoder import AttentionDecoder, Unrolled
from captioner.models.views import back_from_view

LOG_EPS = 1e-12  # floor under α before the log: float32 rounds far-off cells of a sharp map to 0


def symmetric_cross_entropy(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """½ [CE(p, q) + CE(q, p)] of maps (N, L), (N,): smallest, 0, for equal single-cell maps."""
    p, q = p.float(), q.float()
    log_p, log_q = p.clamp_min(LOG_EPS).log(), q.clamp_min(LOG_EPS).log()
    return -0.5 * ((p * log_q).sum(-1) + (q * log_p).sum(-1))


def comparable(maps: torch.Tensor, maps_in_view: torch.Tensor, moves: torch.Tensor, grid: int):
    """The two maps (N, L) of each pair as distributions over the same L + 1 outcomes: the image's
    cells the view also shows (the view's map brought back there), and "elsewhere", the mass on
    cells one of the two does not show (the image's cells moved out of the view, the view's
    uncovered cells)."""
    back, inside = back_from_view(maps_in_view.float(), moves, grid)
    maps = maps.float()
    shared = maps * inside
    return (
        torch.cat([shared, (maps - shared).sum(-1, keepdim=True)], dim=-1),
        torch.cat([back, (1 - back.sum(-1, keepdim=True)).clamp_min(0)], dim=-1),
    )


def real_steps(mask: torch.Tensor, rows: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One random real step (N,) of each caption in `rows`, from the (B, T-1) mask."""
    noise = torch.rand(mask[rows].shape, generator=generator, device=mask.device)
    return noise.masked_fill(~mask[rows], -1.0).argmax(1)


def consistency(
    decoder: AttentionDecoder,
    features: torch.Tensor,
    views: torch.Tensor,
    rows: torch.Tensor,
    moves: torch.Tensor,
    unrolled: Unrolled,
    mask: torch.Tensor,
    words,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """λ's multiplicand per word: the consistency of the maps between the images and their views,
    estimated at one random real step of each caption in `rows` and scaled to the batch's real steps.

    Args:
        features: (B, L, D) the images' raw annotation vectors, as the pass saw them.
        views: (N, L, D) the features of the views (`models.views`) of the images of captions
            `rows` (N,), moved by `moves` (N, 2) cells.
        unrolled: the teacher-forced pass on `features` (its maps α and states h_t).
        mask: (B, T-1) real steps.
        words: what to divide the batch total by.
    """
    steps = real_steps(mask, rows, generator)  # (N,)
    images = decoder.normalize(features[rows])  # (N, L, D)
    h0, _ = decoder.init_state(images)  # (N, H)
    h_before = unrolled.h[rows, (steps - 1).clamp_min(0)]  # (N, H) h_{t-1}
    h_before = torch.where((steps == 0).unsqueeze(1), h0, h_before)
    projected = decoder.attention.project(decoder.normalize(views))  # (N, L, A)
    maps_in_view = decoder.attention(projected, h_before)  # (N, L) α'
    maps = unrolled.alphas[rows, steps]  # (N, L) α
    grid = math.isqrt(maps.size(-1))
    per_step = symmetric_cross_entropy(*comparable(maps, maps_in_view, moves, grid))  # (N,)
    return per_step.mean() * mask.sum() / words
