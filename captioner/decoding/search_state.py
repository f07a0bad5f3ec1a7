"""The state of a batched beam search, and its fixed-shape step: what the one decoding routine
(`decoding.decode`) and its CUDA graphs (`decoding.graphed_search`) share.

Symbols: B images, K beams, N = B·K, L locations, V vocabulary, T steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from captioner.models.decoder import AttentionDecoder, Joined
from captioner.models.vocab import END_ID, PAD_ID, START_ID, UNK_ID

CHECK_EVERY = 4  # fixed shapes: steps between looks at whether any beam still writes


def fixed_length(max_len: int) -> int:
    """The steps a fixed-shape search has room for: max_len words and <end>, in whole blocks of
    `CHECK_EVERY` (after <end> is forced at max_len every beam writes only <pad>, free)."""
    return -(-(max_len + 1) // CHECK_EVERY) * CHECK_EVERY


def banned(*, first: bool, ban_unk: bool = True) -> list[int]:
    """The words a caption may not have at a step, in decoding and in SCST's sampling alike:
    <pad>, <start>, <unk> (unless allowed), and <end> as the first word (every caption has one)."""
    return [PAD_ID, START_ID] + ([UNK_ID] if ban_unk else []) + ([END_ID] if first else [])


@dataclass
class Search:
    """The beams' state, N = B·K rows, and their history as back-pointers (allocated once):
    at step t beam r took word[t, r] after beam parent[t, r], whose state gave α[t, parent]
    and location[t, parent]."""

    feats: torch.Tensor  # (N, L, D)
    projected: torch.Tensor  # (N, L, A)
    h: torch.Tensor  # (N, H)
    c: torch.Tensor  # (N, H)
    words: torch.Tensor  # (N,) each beam's last word
    scores: torch.Tensor  # (B, K) log-probabilities so far
    finished: torch.Tensor  # (N,) beams that emitted <end>
    writing: torch.Tensor  # (N,) beams that take the next step
    word: torch.Tensor  # (T, N)
    parent: torch.Tensor  # (T, N)
    alpha: torch.Tensor  # (T, N, L)
    loc: torch.Tensor  # (T, N)
    joined: Joined  # the decoder's weights for this search
    # What a fixed-shape step adds to each step's log-probabilities (V,): the banned words (-inf),
    # <end> at the first step, all but <end> at the last; and a frozen beam's row (V,): only <pad>, free.
    ban: torch.Tensor
    ban_first: torch.Tensor
    only_end: torch.Tensor
    pad_only: torch.Tensor
    offsets: torch.Tensor  # (B, 1) each image's first beam

    @classmethod
    def start(cls, decoder: AttentionDecoder, features: torch.Tensor, K: int, T: int, ban_unk: bool) -> Search:
        (B, L, _), device = features.shape, features.device
        N, V = B * K, decoder.config.vocab_size
        features = decoder.normalize(features)  # (B, L, D)
        h, c = (x.repeat_interleave(K, dim=0) for x in decoder.init_state(features))  # (N, H)
        scores = torch.full((B, K), float("-inf"), device=device)
        scores[:, 0] = 0.0  # one live beam at first: no duplicates
        masks = torch.zeros(4, V)  # ban, ban_first, only_end, pad_only: made here, one copy to the device
        masks[0, banned(first=False, ban_unk=ban_unk)] = float("-inf")
        masks[1, END_ID] = float("-inf")
        masks[2, :END_ID] = masks[2, END_ID + 1 :] = float("-inf")
        masks[3] = float("-inf")
        masks[3, PAD_ID] = 0.0
        masks = masks.to(device)
        return cls(
            features.repeat_interleave(K, dim=0),
            decoder.attention.project(features).repeat_interleave(K, dim=0),
            h,
            c,
            torch.full((N,), START_ID, dtype=torch.long, device=device),
            scores,
            torch.zeros(N, dtype=torch.bool, device=device),
            scores.view(-1).isfinite(),
            torch.zeros(T, N, dtype=torch.long, device=device),
            torch.zeros(T, N, dtype=torch.long, device=device),
            features.new_zeros(T, N, L),
            torch.full((T, N), -1, dtype=torch.long, device=device),
            decoder.joined(),
            *masks,
            (torch.arange(B, device=device) * K).unsqueeze(1),
        )


def step_every_row(
    decoder: AttentionDecoder, s: Search, t: torch.Tensor, max_len: int, mode: str, generator, sharpness=None
):
    """The decoder's step for every row at step t, its maps and locations written into the history.

    Returns:
        logits (N, V), h (N, H), c (N, H), and what the step adds to the log-probabilities (V,): the
        banned words, <end> at the first step, all but <end> at the last.
    """
    logits, h, c, alpha, loc = decoder.step(
        s.feats, s.projected, s.words, s.h, s.c, mode, generator, s.joined, sharpness
    )
    s.alpha.index_copy_(0, t.view(1), alpha.to(s.alpha.dtype).unsqueeze(0))
    if loc is not None:
        s.loc.index_copy_(0, t.view(1), loc.unsqueeze(0))
    ban = s.ban + torch.where(t == 0, s.ban_first, 0.0) + torch.where(t == max_len, s.only_end, 0.0)  # (V,)
    return logits, h, c, ban


def fixed_step(
    decoder: AttentionDecoder, s: Search, t: torch.Tensor, max_len: int, mode: str, generator, sharpness=None
) -> None:
    """One step of every beam, its state updated in place: the same shapes at every step, no host read.

    Args:
        t: () long, the step (a tensor, so that a captured graph can count it).
        sharpness: k of the maps softmax(k e_t) (None: the model's).
    """
    B, K = s.scores.shape
    V = decoder.config.vocab_size
    logits, h, c, ban = step_every_row(decoder, s, t, max_len, mode, generator, sharpness)
    logp = logits.float().log_softmax(dim=-1) + ban  # (N, V)
    logp = torch.where(s.finished.unsqueeze(1), s.pad_only, logp)  # frozen beams go on through <pad>, free
    scores, flat = (s.scores.view(-1, 1) + logp).view(B, K * V).topk(K, dim=1)  # (B, K)
    source = (s.offsets + flat // V).view(-1)  # (N,) the beam each extends
    words = (flat % V).view(-1)  # (N,)
    s.scores.copy_(scores)
    s.words.copy_(words)
    s.word.index_copy_(0, t.view(1), words.unsqueeze(0))
    s.parent.index_copy_(0, t.view(1), source.unsqueeze(0))
    s.h.copy_(h.index_select(0, source))
    s.c.copy_(c.index_select(0, source))
    s.finished.copy_(s.finished.index_select(0, source) | (words == END_ID))
    s.writing.copy_(~s.finished & s.scores.view(-1).isfinite())
    t.add_(1)
