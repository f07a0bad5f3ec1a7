"""The training objective: a sum of loss terms over one teacher-forced pass.

The soft model's loss is eq. (14): the caption's negative log-likelihood plus the doubly stochastic regularisation
λ Σ_i (1 − Σ_t α_ti)², as two terms. Both are per caption, as in the paper (the likelihood summed over the caption's
words, not averaged), so their balance is the paper's; dividing a batch's total by its predicted words only sets the
scale. The other terms are each a module of their own.

The pass the terms read is made in one of two shapes: packed (CPUs), the fast soft pass with logits at the real
positions only; fixed (GPUs), the plain pass over every step of the batch's padded length, with logits everywhere
and masks, the same shapes at every step of a length bucket and no host synchronisation, so that the step compiles
it. Both give the same values and gradients on the real positions. Hard attention always takes the plain pass, with
sampled locations for the images whose coin says so (§4.1's "semi-sampling").

It is an `nn.Module` so that DistributedDataParallel wraps one forward.
Symbols: B captions, n images, T steps, L locations, D feature size, V vocabulary size, N real positions.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from captioner.data.batches import Views
from captioner.models.decoder import AttentionDecoder, Unrolled, step_mask
from captioner.models.fused import fused_unroll
from captioner.models.views import max_shift, random_shifts
from captioner.objectives.consistency import ViewConsistency
from captioner.objectives.correctness import AttentionCorrectness, ChosenWordCorrectness
from captioner.objectives.reinforce import EntropyBonus, HardAttentionConfig, Reinforce
from captioner.objectives.terms import Context, Setup, Term, TermsConfig, TermState, wide


def attention_penalty(alphas: torch.Tensor, mask: torch.Tensor, alpha_c: float = 1.0) -> torch.Tensor:
    """Doubly stochastic regularisation of eq. (14) per image: λ Σ_i (1 − Σ_t α_ti)², (B,);
    0 for a row without a real step (a padding row of a fixed-shape batch)."""
    attended = (alphas * mask.unsqueeze(2)).sum(dim=1)  # (B, L), Σ_t α_ti over real steps
    return alpha_c * ((1.0 - attended) ** 2).sum(dim=1) * mask.any(dim=1)  # (B,)


class CrossEntropy(Term):
    """Eq. (14)'s first term: −log p(y|a), summed over each caption's words, per word of the batch."""

    name = "nll"

    def __call__(self, ctx: Context) -> torch.Tensor:
        return ctx.passed.nll.sum() / ctx.words


class DoublyStochastic(Term):
    """Eq. (14)'s second term, Σ_i (1 − Σ_t α_ti)² per image, per word of the batch; its weight is λ."""

    name = "penalty"

    @classmethod
    def make(cls, cfg: TermsConfig, setup: Setup) -> Term | None:
        return cls(cfg.alpha_c) if cfg.alpha_c > 0 else None

    def __call__(self, ctx: Context) -> torch.Tensor:
        p = ctx.passed
        return attention_penalty(wide(p.unrolled.alphas), p.mask).sum() / ctx.words


# The terms a run may train with, in the order they run (the order of their random draws); each decides
# from the settings whether this run trains with it (`Term.make`). A new term is its module and one line here.
TERMS: list[type[Term]] = [
    CrossEntropy,
    DoublyStochastic,
    Reinforce,
    EntropyBonus,
    ViewConsistency,
    AttentionCorrectness,
    ChosenWordCorrectness,
]


def objective_terms(
    cfg: TermsConfig, *, attention: str, hard: HardAttentionConfig, views: bool, state: TermState, targets=None
) -> list[Term]:
    """The cross-entropy objective's terms: those of `TERMS` that the settled `cfg` turns on (`Setup` says
    what the other arguments are)."""
    setup = Setup(attention, hard, views, state, targets)
    return [term for kind in TERMS if (term := kind.make(cfg, setup)) is not None]


class Objective(nn.Module):
    """Σ weight × value over `terms`, on one pass over a batch (`teacher_forced` says what `semi_sampling` is).
    `encoder`: the fine-tuned encoder layers (None: cached features), which encode the view of a `view_share` of the
    captions' images for the consistency."""

    def __init__(
        self,
        decoder: AttentionDecoder,
        terms: list[Term],
        *,
        shapes: Shapes = "packed",
        semi_sampling: float | None = None,
        encoder: nn.Module | None = None,
        view_share: float = 0.0,
    ):
        super().__init__()
        self.decoder, self.encoder, self.terms = decoder, encoder, terms
        self.shapes, self.semi_sampling, self.view_share = shapes, semi_sampling, view_share

    @property
    def capturable(self) -> bool:
        """The step can compile the whole objective: fixed shapes, cached features, capturable terms."""
        return self.shapes == "fixed" and self.encoder is None and all(t.capturable for t in self.terms)

    def forward(self, batch, words, generator: torch.Generator | None = None):
        """(loss, {term name: detached value, and what terms report}) for one batch; each term divides its
        batch total by `words` (predicted words; images for SCST)."""
        features = batch.features
        if self.encoder is not None:
            batch, features = self.encoded(batch, generator)
        passed = None
        if any(t.teacher_forced for t in self.terms):
            passed = teacher_forced(
                self.decoder,
                features,
                batch.captions,
                batch.lengths,
                shapes=self.shapes,
                semi_sampling=self.semi_sampling,
                generator=generator,
                predict=any(t.predicts for t in self.terms),
            )
        ctx = Context(self.decoder, batch, features, passed, words, generator)
        values = {t.name: t(ctx) for t in self.terms}
        loss = sum(t.weight * values[t.name] for t in self.terms)
        reported = {k: v.detach() for k, v in values.items()}
        for t in self.terms:
            reported.update(t.report())
        return loss, reported

    def encoded(self, batch, generator):
        """A fine-tuning batch with the encoder's features per caption (B, L, D) and, for the consistency,
        the views of all its images (no gradients: the views teach the attention) for a share of its captions."""
        if self.view_share > 0:
            with torch.no_grad():
                B, n = len(batch.captions), len(batch.features)
                rows = torch.randperm(B, generator=generator, device=batch.captions.device)
                rows = rows[: max(1, math.ceil(self.view_share * B))].sort().values  # (k,)
                moves = random_shifts(n, max_shift(self.encoder.grid(batch.features)), generator, rows.device)
                views = self.encoder(batch.features, moves=moves)  # (n, L, D)
                index = batch.image_index[rows]  # (k,) their images
                batch = replace(batch, views=Views(views[index], rows, moves[index]))
        return batch, self.encoder(batch.features, batch.image_index)  # (B, L, D)


Shapes = Literal["packed", "fixed"]


class TeacherForced(NamedTuple):
    """A teacher-forced pass and its per-position negative log-likelihoods."""

    unrolled: Unrolled  # (B, T-1, ·) states, contexts, maps, locations
    nll: torch.Tensor  # (B, T-1) −log p(y_t), 0 on padding
    mask: torch.Tensor  # (B, T-1) real positions (words and <end>)
    predicted: torch.Tensor | None  # (B, T-1) the most likely word at each position (0 on padding), if asked
    sampled: torch.Tensor | None  # (B,) hard attention: images whose context was a sampled location


def teacher_forced(
    decoder: AttentionDecoder,
    features: torch.Tensor,
    captions: torch.Tensor,
    lengths: torch.Tensor,
    *,
    shapes: Shapes,
    semi_sampling: float | None = None,
    generator: torch.Generator | None = None,
    predict: bool = False,
) -> TeacherForced:
    """The teacher-forced pass over a batch, with its negative log-likelihoods.

    `captions` (B, T) are <start> w1 ... <end> then <pad>, and `lengths` (B,) count <start> and <end>.
    `semi_sampling` (hard attention) is the probability that an image takes the expected context
    instead of sampled locations; None for soft attention."""
    sampled = None
    if semi_sampling is not None:
        sampled = torch.rand(captions.size(0), generator=generator, device=features.device) >= semi_sampling  # (B,)
        u = decoder.unroll(features, captions, sampled=sampled, generator=generator)
    elif shapes == "packed":
        u = fused_unroll(decoder, features, captions)
    else:
        u = decoder.unroll(features, captions)
    mask = step_mask(lengths, u.h.size(1))  # (B, T-1)
    nll, predicted = (_packed_nll if shapes == "packed" else _dense_nll)(decoder, u, captions, mask, predict)
    return TeacherForced(u, nll, mask, predicted, sampled)


def _packed_nll(decoder: AttentionDecoder, u: Unrolled, captions: torch.Tensor, mask: torch.Tensor, predict: bool):
    """Logits at the N real positions only: (B, T-1) nll, 0 on padding, and the most likely words."""
    logits = decoder.output(u.emb[mask], u.h[mask], u.z[mask])  # (N, V)
    nll = torch.zeros(mask.shape, dtype=wide(logits).dtype, device=logits.device)
    nll[mask] = F.cross_entropy(wide(logits), captions[:, 1 : mask.size(1) + 1][mask], reduction="none")
    if not predict:
        return nll, None
    predicted = torch.zeros(mask.shape, dtype=torch.long, device=logits.device)
    predicted[mask] = logits.detach().argmax(-1)
    return nll, predicted


def _dense_nll(decoder: AttentionDecoder, u: Unrolled, captions: torch.Tensor, mask: torch.Tensor, predict: bool):
    """Logits at every position, masked: the same shapes whatever the lengths."""
    B, T1 = mask.shape
    logits = decoder.output(u.emb, u.h, u.z)  # (B, T-1, V)
    targets = captions[:, 1 : T1 + 1]  # (B, T-1)
    nll = F.cross_entropy(wide(logits.flatten(0, 1)), targets.flatten(), reduction="none").view(B, T1) * mask
    if not predict:
        return nll, None
    return nll, logits.detach().argmax(-1) * mask
