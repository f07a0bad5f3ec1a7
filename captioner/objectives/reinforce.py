"""Hard attention's training objective, §4.1 of the paper (eqs. 10–12).

With locations s sampled from α, the variational lower bound L_s = Σ_s p(s|a) log p(y|s,a) has
the Monte-Carlo gradient
    ∂log p(y|s̃,a) + λ_r (log p(y|s̃,a) − b) ∂log p(s̃|a) + λ_e ∂H[s̃]
with a moving-average baseline b ← 0.9 b + 0.1 log p(y|s̃,a). We build a surrogate loss whose
gradient is exactly that estimator. With probability `semi_sampling` a caption uses the
expected context (soft attention) for all its steps instead of sampled locations (§4.1's
"semi-sampling").

Where this departs from the authors' released code (kelvinxu/arctic-captions, capgen.py), and why:
- the semi-sampling coin is drawn per image, not once per minibatch (`binomial((1,))` there), so
  every batch mixes both kinds of captions and the attention MLP gets both gradients each step;
- the reward is the caption's log-likelihood log p(y|s̃,a), summed over its words, as in eq. (12),
  where the code's default (`RL_sumCost`) uses the mean cost per step; λ_r = 0.01 on the sum
  weighs the REINFORCE term about as the authors' 0.1 on the mean does for captions of ten words
  (docs/results.md: at 0.1 on the sum, maps could settle beside every object);
- the baseline averages the summed log-likelihoods, to match.

"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import torch

from captioner.objectives.cross_entropy import attention_penalty, word_nll

LOG_EPS = 1e-12  # floor under α before the log: a sampled location always has α > 0, but float32 may round


@dataclass
class HardAttentionConfig:
    """Hard attention (`--attention hard`): REINFORCE settings."""

    entropy_weight: Annotated[float, "hard attention: λ_e, the weight of the entropy bonus"] = 0.002
    reward_scale: Annotated[float, "hard attention: λ_r, the weight of the REINFORCE term"] = 0.01
    semi_sampling: Annotated[
        float, "hard attention: probability that an image uses the expected context instead of a sampled location"
    ] = 0.5
    baseline_decay: Annotated[float, "hard attention: decay of the moving-average baseline"] = 0.9


def reinforce_surrogate(
    logp_y: torch.Tensor,
    logp_s: torch.Tensor,
    entropy: torch.Tensor,
    baseline: float,
    reward_scale: float,
    entropy_weight: float,
) -> torch.Tensor:
    """Per-caption surrogate whose gradient is the estimator of eq. (12); to be maximised.

    Args:
        logp_y: (B,) log p(y|s̃,a) per caption, differentiable.
        logp_s: (B,) log p(s̃|a), summed over the caption's steps (0 for unsampled captions).
        entropy: (B,) H[s] summed over steps.
        baseline: b.
    """
    advantage = logp_y.detach() - baseline  # (B,), no gradient through the reward
    return logp_y + reward_scale * advantage * logp_s + entropy_weight * entropy


def hard_attention_loss(
    model,
    features,
    captions,
    lengths,
    *,
    baseline: float,
    cfg: HardAttentionConfig,
    alpha_c: float,
    generator: torch.Generator | None = None,
    words: torch.Tensor | float | None = None,
):
    """Loss for one batch of hard attention training.

    Args:
        baseline: b, the moving average of log p(y|s̃,a) so far.
        words: what to divide the batch totals by (default: this batch's predicted words;
            under DDP, the global count over processes).

    Returns:
        (loss to minimise, dict of detached terms for logging, with "reward_sum" and
        "sampled" to update the baseline by `update_baseline`, the `Unrolled` pass, and its
        (B, T-1) mask of real steps, for terms computed on the same maps)
    """
    B = features.size(0)
    sampled = torch.rand(B, generator=generator, device=features.device) >= cfg.semi_sampling  # (B,)
    u = model.unroll(features, captions, sampled=sampled, generator=generator)
    alphas, locs = u.alphas, u.locations
    nll, mask, _ = word_nll(model, u, captions, lengths)  # (B, T-1)
    mask = mask.float()
    logp_y = -nll.sum(1)  # (B,)
    log_alpha = alphas.float().clamp_min(LOG_EPS).log()  # (B, T-1, L)
    picked = log_alpha.gather(2, locs.clamp_min(0).unsqueeze(2)).squeeze(2)  # (B, T-1)
    logp_s = (picked * mask * (locs >= 0)).sum(1)  # (B,)
    entropy = (-(alphas.float() * log_alpha).sum(2) * mask).sum(1)  # (B,)
    objective = reinforce_surrogate(logp_y, logp_s, entropy, baseline, cfg.reward_scale, cfg.entropy_weight)
    words = mask.sum() if words is None else words
    penalty = attention_penalty(alphas.float(), mask, alpha_c).sum() / words
    loss = -objective.sum() / words + penalty
    drawn = (locs >= 0).any(dim=1)  # (B,)
    terms = {
        "nll": -logp_y.detach().sum() / words,
        "penalty": penalty.detach(),
        "entropy": entropy.detach().sum() / words,
        "reward_sum": logp_y.detach()[drawn].sum(),
        "sampled": drawn.sum().float(),
    }
    return loss, terms, u, mask.bool()


def update_baseline(baseline: float, reward_sum: float, sampled: float, decay: float) -> float:
    """b ← decay·b + (1 − decay)·(mean log p(y|s̃,a) of the captions that sampled locations)."""
    if sampled <= 0:
        return baseline
    return decay * baseline + (1 - decay) * reward_sum / sampled
