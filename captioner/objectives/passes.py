"""The teacher-forced pass the terms read, made in one of two shapes.

- packed (CPUs): the fast soft pass, with logits at the real positions only;
- fixed (GPUs): the plain pass over every step of the batch's padded length, with logits everywhere
  and masks: the same shapes at every step of a length bucket and no host synchronisation, so the
  step compiles it.
Both give the same values and gradients on the real positions. Hard attention always takes the
plain pass, with sampled locations for the images whose coin says so (§4.1's "semi-sampling").

Symbols: B captions, T steps, L locations, D feature size, V vocabulary size, N real positions.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F

from captioner.models.decoder import AttentionDecoder, Unrolled, step_mask
from captioner.models.fused import fused_unroll
from captioner.objectives.terms import wide

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
    instead of sampled locations; None for soft attention.
    """
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
