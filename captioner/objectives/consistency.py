"""View consistency: attention that looks at the objects themselves, learnt without boxes.

Each map is asked to be found again in a view of the image (`models.views`: turned 180° and moved by
one or two whole cells) and to be sharp: C_t = −log Σ_i α_ti (V⁻¹α'_t)_i, where α_t is the map on the
image, α'_t the map the same state h_{t−1} gives on the view, and V⁻¹ brings a map on the view back
onto the image's cells. Only sharp maps that follow the content make it small; h_{t−1} is detached,
so the term trains where to look, not the LSTM's state. Why: docs/attention.md#view-consistency.
Symbols: B captions, T steps, L locations, D feature size, H LSTM size, E embedding size, N picked
(caption, step) pairs.
"""

from __future__ import annotations

import math

import torch

from captioner.models.decoder import AttentionDecoder, Unrolled
from captioner.models.views import back_from_view
from captioner.objectives.terms import Context, Setup, Term, TermsConfig, wide

AGREEMENT_FLOOR = 1e-6  # under the agreement before the log: maps that share no cell cost log 1e6, not inf


def disagreement(maps: torch.Tensor, maps_in_view: torch.Tensor, moves: torch.Tensor, grid: int) -> torch.Tensor:
    """−log Σ_i α_i (V⁻¹α')_i per pair (N,): −log of the chance that a cell drawn from each map is the same cell of the
    image. Mass on cells only one of the two shows agrees with nothing: it pays like mass on the wrong cell."""
    back = back_from_view(wide(maps_in_view), moves, grid)
    return -((wide(maps) * back).sum(-1) + AGREEMENT_FLOOR).log()


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
    """λ's multiplicand per word: the consistency between the maps on `features` (B, L, D) and on `views`
    (N, L, D), the views of captions `rows` (N,) moved by `moves` (N, 2) cells, estimated at one random real
    step of each of those captions and scaled to the batch's real steps (`mask`, (B, T-1))."""
    steps = real_steps(mask, rows, generator)  # (N,)
    images = decoder.normalize(features[rows])  # (N, L, D)
    h0, _ = decoder.init_state(images)  # (N, H)
    h_before = unrolled.h[rows, (steps - 1).clamp_min(0)]  # (N, H) h_{t-1}
    h_before = torch.where((steps == 0).unsqueeze(1), h0, h_before).detach()
    word_before = unrolled.emb[rows, steps].detach()  # (N, E) E y_{t-1}
    maps = decoder.attend(decoder.attention.project(images), h_before, word_before)  # (N, L) α
    maps_in_view = decoder.attend(decoder.attention.project(decoder.normalize(views)), h_before, word_before)  # α'
    grid = math.isqrt(maps.size(-1))
    per_step = disagreement(maps, maps_in_view, moves, grid)  # (N,)
    real = mask[rows].any(1)  # (N,) False for a padding row of a fixed-shape batch
    return (per_step * real).sum() / real.sum().clamp_min(1) * mask.sum() / words


class ViewConsistency(Term):
    """The consistency of the maps between each image and its view (`consistency`), per word; its
    weight is `--consistency`. A batch without views (every picked image damaged) adds nothing."""

    name = "consistency"

    @classmethod
    def make(cls, cfg: TermsConfig, setup: Setup) -> Term | None:
        return cls(cfg.consistency) if setup.views and cfg.consistency > 0 else None

    def __call__(self, ctx: Context) -> torch.Tensor:
        b, p = ctx.batch, ctx.passed
        if b.views is None:
            return ctx.features.new_zeros(())
        return consistency(ctx.decoder, ctx.features, *b.views, p.unrolled, p.mask, ctx.words, ctx.generator)
