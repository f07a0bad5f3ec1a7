"""The soft attention model's loss, eq. (14): the caption's negative log-likelihood plus the
doubly stochastic regularisation λ Σ_i (1 − Σ_t α_ti)², as two terms.

Both are per caption, as in the paper (the likelihood summed over the caption's words, not
averaged), so their balance is the paper's; dividing a batch's total by its predicted words
only sets the scale. Symbols: B captions, T steps, L locations.
"""

from __future__ import annotations

import torch

from captioner.objectives.terms import Context, Setup, Term, TermsConfig, wide


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
