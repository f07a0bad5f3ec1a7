"""The training objective: a sum of loss terms over one teacher-forced pass.

It is an `nn.Module` so that DistributedDataParallel wraps one forward. With a fine-tuned encoder
the batch holds the encoder's inputs, one per image, which the objective encodes first.

Symbols: B captions, n images, L locations, D feature size.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import nn

from captioner.data.batches import Views
from captioner.models.decoder import AttentionDecoder
from captioner.models.views import max_shift, random_shifts
from captioner.objectives.consistency import ViewConsistency
from captioner.objectives.correctness import AttentionCorrectness, ChosenWordCorrectness
from captioner.objectives.cross_entropy import CrossEntropy, DoublyStochastic
from captioner.objectives.passes import Shapes, teacher_forced
from captioner.objectives.reinforce import EntropyBonus, HardAttentionConfig, Reinforce
from captioner.objectives.terms import Context, Setup, Term, TermsConfig, TermState

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
    cfg: TermsConfig,
    *,
    attention: str,
    hard: HardAttentionConfig,
    views: bool,
    state: TermState,
    targets=None,
) -> list[Term]:
    """The cross-entropy objective's terms: those of `TERMS` that the settled `cfg` turns on (`Setup` says
    what the other arguments are)."""
    setup = Setup(attention, hard, views, state, targets)
    return [term for kind in TERMS if (term := kind.make(cfg, setup)) is not None]


class Objective(nn.Module):
    """Σ weight × value over `terms`, on one pass over a batch.

    `semi_sampling` is hard attention's share of images on the expected context (None: soft); `encoder`
    the fine-tuned encoder layers (None: cached features), which encode the view of a `view_share` of
    the captions' images for the consistency.
    """

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
