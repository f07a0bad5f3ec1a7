"""Half-turn consistency: attention that looks at the objects themselves, learnt without boxes.

Trained on captions alone, attention need not look at what a word names: the LSTM's initial
state already summarises the image, so a map may rest on the grid's border, spread evenly, or
sit a cell beside the object (a conv5 cell sees its neighbours). This term asks each map to be
found again when the image is turned half a turn, and to be sharp:

    C_t = ½ [ CE(R α_t, α'_t) + CE(α'_t, R α_t) ],   CE(p, q) = −Σ_i p_i log q_i,

where α_t is the map on the image, α'_t the map the same state h_{t−1} gives on the image turned
180° (`prepare` stores those features), and R turns a map back. A cross-entropy is smallest when
both maps are the same single cell, so the only maps that make it small are sharp ones that
follow the content through the turn. Each failure above pays: a map parked at a place on the
grid stays there when the content turns; an offset from the object flips sides; an even map or a
pair of cells mirrored through the centre costs log of its spread. Looking at the object costs
nothing. Captions are not trained on the turned images, so "left" and "right" need no rewriting.

The term is estimated on a share of each batch's captions (the loader reads the turned features
of those only: `CaptionData.turned_share`), at one random real step each, and scaled to the
batch's words, so its cost stays small: one attention map per picked caption (no second LSTM
pass) and the projection of those captions' turned images.

Symbols: B captions, T steps, L locations, D feature size, A attention size, H LSTM size, N
picked (caption, step) pairs.
"""

from __future__ import annotations

import torch

from captioner.models.decoder import AttentionDecoder, Unrolled

LOG_EPS = 1e-12  # floor under α before the log: float32 rounds far-off cells of a sharp map to 0


def half_turn(maps: torch.Tensor) -> torch.Tensor:
    """Maps (..., L) over a row-major grid, turned 180°: reversing the flattened locations."""
    return maps.flip(-1)


def symmetric_cross_entropy(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """½ [CE(p, q) + CE(q, p)] of maps (N, L), (N,): smallest, 0, for equal single-cell maps."""
    p, q = p.float(), q.float()
    log_p, log_q = p.clamp_min(LOG_EPS).log(), q.clamp_min(LOG_EPS).log()
    return -0.5 * ((p * log_q).sum(-1) + (q * log_p).sum(-1))


def real_steps(mask: torch.Tensor, rows: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One random real step (N,) of each caption in `rows`, from the (B, T-1) mask."""
    noise = torch.rand(mask[rows].shape, generator=generator, device=mask.device)
    return noise.masked_fill(~mask[rows], -1.0).argmax(1)


def consistency(
    decoder: AttentionDecoder,
    features: torch.Tensor,
    turned: torch.Tensor,
    rows: torch.Tensor,
    unrolled: Unrolled,
    mask: torch.Tensor,
    words,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """λ's multiplicand per word: the half-turn consistency of the maps, estimated at one random
    real step of each caption in `rows` and scaled to the batch's real steps.

    Args:
        features: (B, L, D) the images' raw annotation vectors, as the pass saw them.
        turned: (N, L, D) the images of captions `rows` (N,) turned 180°.
        unrolled: the teacher-forced pass on `features` (its maps α and states h_t).
        mask: (B, T-1) real steps.
        words: what to divide the batch total by.
    """
    steps = real_steps(mask, rows, generator)  # (N,)
    images = decoder.normalize(features[rows])  # (N, L, D)
    h0, _ = decoder.init_state(images)  # (N, H)
    h_before = unrolled.h[rows, (steps - 1).clamp_min(0)]  # (N, H) h_{t-1}
    h_before = torch.where((steps == 0).unsqueeze(1), h0, h_before)
    projected = decoder.attention.project(decoder.normalize(turned))  # (N, L, A)
    maps_turned = decoder.attention(projected, h_before)  # (N, L) α'
    maps = unrolled.alphas[rows, steps]  # (N, L) α
    per_step = symmetric_cross_entropy(half_turn(maps), maps_turned)  # (N,)
    return per_step.mean() * mask.sum() / words
