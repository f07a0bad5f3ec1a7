"""f_att, the attention MLP of "Show, Attend and Tell" eqs. (4)-(5) (Xu et al., 2015), and how hard
attention chooses a location from its map (§4.1). Shapes as in `models.decoder`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from captioner.models.contexts import ARGMAX, CONTEXT_MODES, EXPECTED, SAMPLE

__all__ = ["ARGMAX", "CONTEXT_MODES", "EXPECTED", "SAMPLE", "Attention", "choose_locations", "sample_from"]


class Attention(nn.Module):
    """f_att, the MLP of eq. (4): e_ti = v·tanh(W_a a_i + W_h h_{t-1}); α_t = softmax(e_t), eq. (5).

    With `embed_dim`, the query also holds the word just written (+ W_y E y_{t-1}): h_{t-1} has not seen
    y_{t-1}, so without it the map for "triangle" in "a yellow triangle" cannot know which object was chosen.

    Computed as e_ti = 2v·σ(2 W_a a_i + 2 W_h h_{t-1}): tanh(x) = 2σ(2x) − 1, so the two differ by −Σv at
    every location, which softmax ignores; σ is the cheaper of the two on CPUs.
    """

    def __init__(self, encoder_dim: int, hidden_dim: int, attention_dim: int, embed_dim: int | None = None):
        super().__init__()
        self.W_a = nn.Linear(encoder_dim, attention_dim)  # annotation → attention space
        self.W_h = nn.Linear(hidden_dim, attention_dim, bias=False)  # previous state → attention space
        self.v = nn.Linear(attention_dim, 1, bias=False)  # score per location
        # previous word → attention space
        self.W_y = None if embed_dim is None else nn.Linear(embed_dim, attention_dim, bias=False)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """2 W_a a_i for all locations: once per image, not once per step."""
        return F.linear(features, 2 * self.W_a.weight, 2 * self.W_a.bias)  # (B, L, A)

    def query(self, h: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """W_h h_{t-1} (+ W_y E y_{t-1}) (B, A)."""
        q = self.W_h(h)
        return q if self.W_y is None else q + self.W_y(emb)

    def forward(self, projected: torch.Tensor, h: torch.Tensor, emb: torch.Tensor, sharpness: float = 1.0):
        """α_t (B, L) = softmax(k e_t), with `sharpness` k (decoding; 1 is the paper's map)."""
        s = torch.sigmoid(projected + 2 * self.query(h, emb).unsqueeze(1))  # (B, L, A)
        e = s @ (2 * sharpness * self.v.weight.view(-1))  # (B, L), k e_t
        return e.softmax(dim=1)  # (B, L), sums to 1


def choose_locations(alpha: torch.Tensor, mode: str, generator: torch.Generator | None = None):
    """The location each row attends (B,) for hard attention's modes; None for the expected context.
    `mode` is one of CONTEXT_MODES: the settings that carry it refuse any other as they are made."""
    if mode == EXPECTED:
        return None
    if mode == SAMPLE:
        return sample_from(alpha, generator)  # (B,)
    return alpha.argmax(dim=1)  # (B,), ARGMAX


def sample_from(p: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One index (B,) drawn from each row of probabilities p (B, N): argmax p / q with q ~ Exp(1), the
    draw `torch.multinomial(p, 1)` makes (the same indices from the same generator state), without the
    validity check that reads the probabilities back to the host."""
    q = torch.empty_like(p, dtype=torch.float32).exponential_(generator=generator)  # (B, N)
    return (p.float() / q).argmax(dim=1)
