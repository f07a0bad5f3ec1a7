"""The soft attention model's loss, eq. (14): the caption's negative log-likelihood plus the
doubly stochastic regularisation λ Σ_i (1 − Σ_t α_ti)².

Both terms are per caption, as in the paper (the likelihood summed over the caption's words,
not averaged), so their balance is the paper's; dividing a batch's total by its predicted words
only sets the scale. Padding is masked out of both.
Symbols: B captions, T steps, L locations, V vocabulary size, N real (non-padding) positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from captioner.models.decoder import AttentionDecoder, Unrolled, step_mask


def word_nll(
    decoder: AttentionDecoder, unrolled: Unrolled, captions: torch.Tensor, lengths: torch.Tensor, predict: bool = False
):
    """−log p(y_t) at every real position; logits are computed there only, not on padding.

    Returns:
        (B, T-1) negative log-likelihoods (0 on padding), the (B, T-1) mask, and with `predict` the
        (B, T-1) most likely word at each position (0 on padding), else None.
    """
    T1 = unrolled.h.size(1)
    mask = step_mask(lengths, T1)  # (B, T-1)
    logits = decoder.output(unrolled.emb[mask], unrolled.h[mask], unrolled.z[mask])  # (N, V)
    nll = torch.zeros(mask.shape, dtype=torch.float32, device=logits.device)
    nll[mask] = F.cross_entropy(logits.float(), captions[:, 1 : T1 + 1][mask], reduction="none")
    if not predict:
        return nll, mask, None
    predicted = torch.zeros(mask.shape, dtype=torch.long, device=logits.device)
    predicted[mask] = logits.detach().argmax(-1)
    return nll, mask, predicted


def attention_penalty(alphas: torch.Tensor, mask: torch.Tensor, alpha_c: float = 1.0) -> torch.Tensor:
    """Doubly stochastic regularisation of eq. (14) per image: λ Σ_i (1 − Σ_t α_ti)², (B,)."""
    attended = (alphas * mask.unsqueeze(2)).sum(dim=1)  # (B, L), Σ_t α_ti over real steps
    return alpha_c * ((1.0 - attended) ** 2).sum(dim=1)  # (B,)


def sequence_terms(
    decoder: AttentionDecoder,
    features: torch.Tensor,
    captions: torch.Tensor,
    lengths: torch.Tensor,
    alpha_c: float = 1.0,
    words: torch.Tensor | float | None = None,
    predict: bool = False,
):
    """Eq. (14)'s two terms per predicted word, with logits only where there are words, and the
    teacher-forced pass and its (B, T-1) mask of real steps (for terms computed on the same maps).

    Args:
        words: what to divide the batch totals by; default the batch's predicted words (under
            DDP, the global count divided by the number of processes).
        predict: also return the most likely word at each step (`word_nll`).

    Returns:
        (nll per word, penalty per word, the `Unrolled` pass, the mask, the most likely words or None).
    """
    u = decoder.teacher_forced(features, captions)
    nll, mask, predicted = word_nll(decoder, u, captions, lengths, predict)
    words = mask.sum() if words is None else words
    return nll.sum() / words, attention_penalty(u.alphas.float(), mask, alpha_c).sum() / words, u, mask, predicted


def caption_loss(
    logits: torch.Tensor,
    alphas: torch.Tensor,
    captions: torch.Tensor,
    lengths: torch.Tensor,
    alpha_c: float = 1.0,
    words: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. (14) from `AttentionDecoder.forward`'s logits (B, T-1, V) and maps (B, T-1, L).

    Returns:
        (negative log-likelihood per word, penalty per word); the loss is their sum.
    """
    B, T1, V = logits.shape
    mask = step_mask(lengths, T1)  # (B, T-1)
    nll = F.cross_entropy(logits.reshape(-1, V).float(), captions[:, 1 : T1 + 1].reshape(-1), reduction="none").view(
        B, T1
    )  # (B, T-1)
    words = mask.sum() if words is None else words
    return (nll * mask).sum() / words, attention_penalty(alphas.float(), mask, alpha_c).sum() / words
