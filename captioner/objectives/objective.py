"""The training objective: a sum of loss terms over one teacher-forced pass.

The soft model's loss is eq. (14): the caption's negative log-likelihood plus the doubly stochastic regularisation
λ Σ_i (1 − Σ_t α_ti)², as two terms. Both are per caption, as in the paper (the likelihood summed over the caption's
words, not averaged), so their balance is the paper's; dividing a batch's total by its predicted words only sets the
scale. Hard attention's is §4.1's (eqs. 10–12): with locations s̃ sampled from α, the Monte-Carlo gradient of the
bound L_s is ∂log p(y|s̃,a) + λ_r (log p(y|s̃,a) − b) ∂log p(s̃|a) + λ_e ∂H[s̃], b a moving average of log p(y|s̃,a):
the cross-entropy term, `Reinforce` and `EntropyBonus`. Our attention terms are in `objectives.terms`.

Where hard attention departs from the authors' released code (kelvinxu/arctic-captions), and why:
- the semi-sampling coin is drawn per image, not once per minibatch, so every batch mixes both kinds of captions and
  the attention MLP gets both gradients each step;
- the reward is log p(y|s̃,a) summed over the caption's words, as in eq. (12), not the code's mean per step; λ_r = 0.01
  on the sum weighs about as the authors' 0.1 on the mean for ten words (at 0.1 on the sum, maps could settle beside
  every object); the baseline averages the sums, to match.

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
from dataclasses import dataclass, replace
from typing import Annotated, Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from captioner.data.batches import Views
from captioner.models.decoder import AttentionDecoder, Unrolled, step_mask
from captioner.models.fused import fused_unroll
from captioner.models.views import max_shift, random_shifts
from captioner.objectives.terms import (
    LOG_EPS,
    AttentionCorrectness,
    ChosenWordCorrectness,
    Context,
    Setup,
    Term,
    TermsConfig,
    TermState,
    ViewConsistency,
    wide,
)


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


@dataclass(frozen=True)
class HardAttentionConfig:
    """Hard attention (`--attention hard`): REINFORCE settings."""

    entropy_weight: Annotated[float, "hard attention: λ_e, the weight of the entropy bonus"] = 0.002
    reward_scale: Annotated[float, "hard attention: λ_r, the weight of the REINFORCE term"] = 0.01
    semi_sampling: Annotated[
        float, "hard attention: probability that an image uses the expected context instead of a sampled location"
    ] = 0.5
    baseline_decay: Annotated[float, "hard attention: decay of the moving-average baseline"] = 0.9


class Reinforce(Term):
    """The REINFORCE part of eq. (12) as a loss: −Σ (log p(y|s̃,a) − b) log p(s̃|a) per word, weighted by λ_r (no
    gradient through the reward). b moves after each applied step, over the captions that sampled locations only."""

    name = "reinforce"

    @classmethod
    def make(cls, cfg: TermsConfig, setup: Setup) -> Term | None:
        return cls(setup.hard, setup.state) if setup.attention == "hard" else None

    def __init__(self, cfg: HardAttentionConfig, state: TermState):
        super().__init__(cfg.reward_scale)
        self.decay = cfg.baseline_decay
        self.baseline = state.claim(self.name, baseline=torch.zeros(()))["baseline"]  # () b, updated in place
        self.sums: list[torch.Tensor] = []  # [Σ log p(y|s̃,a), captions] of the last batch's sampled captions

    def __call__(self, ctx: Context) -> torch.Tensor:
        p = ctx.passed
        alphas, locs, mask = p.unrolled.alphas, p.unrolled.locations, p.mask
        logp_y = -p.nll.sum(1)  # (B,)
        log_alpha = wide(alphas).clamp_min(LOG_EPS).log()  # (B, T-1, L)
        picked = log_alpha.gather(2, locs.clamp_min(0).unsqueeze(2)).squeeze(2)  # (B, T-1)
        logp_s = (picked * mask * (locs >= 0)).sum(1)  # (B,)
        advantage = logp_y.detach() - self.baseline  # (B,)
        drawn = (locs >= 0).any(dim=1) & mask.any(dim=1)  # (B,) captions that sampled locations
        self.sums = [(logp_y.detach() * drawn).sum(), drawn.sum().float()]
        return -(advantage * logp_s).sum() / ctx.words

    def shared(self) -> list[torch.Tensor]:
        return self.sums

    def after_step(self, applied: torch.Tensor) -> None:
        reward_sum, sampled = self.sums
        moved = self.decay * self.baseline + (1 - self.decay) * reward_sum / sampled.clamp_min(1)
        self.baseline.copy_(torch.where(applied & (sampled > 0), moved, self.baseline))

    def report(self) -> dict[str, torch.Tensor]:
        return {"baseline": self.baseline.detach().clone()}


class EntropyBonus(Term):
    """λ_e H[s̃]: the entropy of the attention, summed over each caption's steps, per word; a bonus
    (the objective maximises it), so its weight is −λ_e."""

    name = "entropy"

    @classmethod
    def make(cls, cfg: TermsConfig, setup: Setup) -> Term | None:
        return cls(setup.hard.entropy_weight) if setup.attention == "hard" else None

    def __init__(self, entropy_weight: float):
        super().__init__(-entropy_weight)

    def __call__(self, ctx: Context) -> torch.Tensor:
        p = ctx.passed
        alphas = wide(p.unrolled.alphas)  # (B, T-1, L)
        entropy = -(alphas * alphas.clamp_min(LOG_EPS).log()).sum(2)  # (B, T-1)
        return (entropy * p.mask).sum() / ctx.words


# The terms a run may train with, in the order they run (the order of their random draws); each decides
# from the settings whether this run trains with it (`Term.make`). A new term is its class and one line here.
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
