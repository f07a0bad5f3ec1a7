"""Hard attention's training objective, §4.1 of the paper (eqs. 10–12).

With locations s sampled from α, the variational lower bound L_s = Σ_s p(s|a) log p(y|s,a) has
the Monte-Carlo gradient
    ∂log p(y|s̃,a) + λ_r (log p(y|s̃,a) − b) ∂log p(s̃|a) + λ_e ∂H[s̃]
with a moving-average baseline b ← 0.9 b + 0.1 log p(y|s̃,a): the cross-entropy term, `Reinforce`
and `EntropyBonus`.

Where this departs from the authors' released code (kelvinxu/arctic-captions), and why:
- the semi-sampling coin is drawn per image, not once per minibatch, so every batch mixes both
  kinds of captions and the attention MLP gets both gradients each step;
- the reward is log p(y|s̃,a) summed over the caption's words, as in eq. (12), not the code's mean
  per step; λ_r = 0.01 on the sum weighs about as the authors' 0.1 on the mean for ten words (at
  0.1 on the sum, maps could settle beside every object); the baseline averages the sums, to match.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import torch

from captioner.objectives.terms import Context, Setup, Term, TermsConfig, TermState, wide

LOG_EPS = 1e-12  # floor under α before the log: a sampled location always has α > 0, but float32 may round


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
