"""Hard attention's training objective, §4.1 of the paper (eqs. 10–12).

With locations s sampled from α, the variational lower bound L_s = Σ_s p(s|a) log p(y|s,a) has
the Monte-Carlo gradient
    ∂log p(y|s̃,a) + λ_r (log p(y|s̃,a) − b) ∂log p(s̃|a) + λ_e ∂H[s̃]
with a moving-average baseline b ← 0.9 b + 0.1 log p(y|s̃,a). We build a surrogate loss whose
gradient is exactly that estimator. With probability `semi_sampling` an image uses the
expected context (soft attention) for the whole caption instead, as the authors did.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .decoder import attention_penalty, step_mask

LOG_EPS = 1e-12  # floor under α before the log: a sampled location always has α > 0, but float32 may round


@dataclass
class HardAttentionConfig:
    """REINFORCE settings; defaults follow the authors' released code."""
    entropy_weight: float = 0.002    # λ_e
    reward_scale: float = 0.1        # λ_r
    semi_sampling: float = 0.5       # probability that an image uses the expected context
    baseline_decay: float = 0.9


def reinforce_surrogate(logp_y: torch.Tensor, logp_s: torch.Tensor, entropy: torch.Tensor,
                        baseline: float, reward_scale: float, entropy_weight: float) -> torch.Tensor:
    """Per-caption surrogate whose gradient is the estimator of eq. (12); to be maximised.

    Args:
        logp_y: (B,) log p(y|s̃,a) per caption, differentiable.
        logp_s: (B,) log p(s̃|a), summed over the caption's steps (0 for unsampled captions).
        entropy: (B,) H[s] summed over steps.
        baseline: b.
    """
    advantage = (logp_y.detach() - baseline)                          # (B,), no gradient through the reward
    return logp_y + reward_scale * advantage * logp_s + entropy_weight * entropy


def hard_attention_loss(model, features, captions, lengths, *, baseline: float, cfg: HardAttentionConfig,
                        alpha_c: float, generator: torch.Generator | None = None):
    """Loss for one batch of hard attention training.

    Returns:
        (loss to minimise, dict of floats for logging, updated baseline)
    """
    B = features.size(0)
    sampled = torch.rand(B, generator=generator, device=features.device) >= cfg.semi_sampling  # (B,)
    logits, alphas, locs = model.unroll(features, captions, sampled=sampled, generator=generator)
    T1 = logits.size(1)
    mask = step_mask(lengths, T1).float()                                                    # (B, T-1)
    nll = F.cross_entropy(logits.transpose(1, 2), captions[:, 1:T1 + 1], reduction="none")     # (B, T-1)
    logp_y = -(nll * mask).sum(1)                                                             # (B,)
    log_alpha = alphas.clamp_min(LOG_EPS).log()                                               # (B, T-1, L)
    picked = log_alpha.gather(2, locs.clamp_min(0).unsqueeze(2)).squeeze(2)                   # (B, T-1)
    logp_s = (picked * mask * sampled.unsqueeze(1)).sum(1)                                    # (B,)
    entropy = (-(alphas * log_alpha).sum(2) * mask).sum(1)                                    # (B,)
    objective = reinforce_surrogate(logp_y, logp_s, entropy, baseline, cfg.reward_scale, cfg.entropy_weight)
    words = mask.sum()
    penalty = attention_penalty(alphas, mask, alpha_c).sum() / mask.sum()
    loss = -objective.sum() / words + penalty
    if bool(sampled.any()):
        reward = logp_y.detach()[sampled].mean().item()
        baseline = cfg.baseline_decay * baseline + (1 - cfg.baseline_decay) * reward
    terms = {"nll": (-logp_y.detach().sum() / words).item(), "penalty": penalty.item(),
             "entropy": (entropy.detach().sum() / words).item(), "baseline": baseline}
    return loss, terms, baseline
