"""The one decoding routine: batched beam search (greedy is beam size 1 of it).

Used by validation, evaluation, the Python API, the web demo and the notebooks. Each image
keeps K beams; a beam that emits <end> is frozen (it extends only with <pad> at no cost) so all
beams advance in lock-step as tensors; at `max_len` words every unfinished beam is made to end,
so the search always terminates.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .decoder import EXPECTED, AttentionDecoder
from .vocab import END_ID, PAD_ID, START_ID, UNK_ID


@dataclass
class Hypothesis:
    """One decoded caption."""
    tokens: list[int]         # word ids, without <start> and <end>
    score: float              # sum of log-probabilities, <end> included
    attention: np.ndarray     # (len(tokens), L): α used to produce each word
    locations: np.ndarray     # (len(tokens),): chosen location per word (-1 for expected context)
    ended: bool               # False when cut at max_len

    @property
    def normalized_score(self) -> float:
        return self.score / (len(self.tokens) + 1)


@torch.inference_mode()
def beam_search(decoder: AttentionDecoder, features: torch.Tensor, *, beam_size: int = 3,
                max_len: int = 20, length_norm: bool = False, ban_unk: bool = True,
                mode: str = EXPECTED, generator: torch.Generator | None = None) -> list[list[Hypothesis]]:
    """Decode a batch of images.

    Args:
        decoder: the model (call .eval() first so dropout is off).
        features: (B, L, D) annotation vectors.
        beam_size: K; 1 is greedy decoding.
        max_len: most words per caption (before <end>).
        length_norm: rank finished captions by score per token instead of total score.
        ban_unk: never emit <unk>.
        mode: context from α: "expected" (soft), "argmax" or "sample" (hard models).
        generator: random source for mode="sample".

    Returns:
        For each image, its K hypotheses, best first.
    """
    B, L, _ = features.shape
    K, V = beam_size, decoder.config.vocab_size
    if K < 1 or max_len < 1:
        raise ValueError(f"beam_size and max_len must be positive, got {K} and {max_len}")
    features = decoder.normalize(features)                                # (B, L, D)
    feats = features.repeat_interleave(K, dim=0)                          # (B*K, L, D)
    projected = decoder.attention.project(features).repeat_interleave(K, dim=0)  # (B*K, L, A)
    h, c = (s.repeat_interleave(K, dim=0) for s in decoder.init_state(features))  # (B*K, H)
    words = torch.full((B * K,), START_ID, dtype=torch.long, device=features.device)
    scores = torch.full((B, K), float("-inf"), device=features.device)
    scores[:, 0] = 0.0                                       # one live beam at first: no duplicates
    finished = torch.zeros(B * K, dtype=torch.bool, device=features.device)
    tokens = torch.zeros(B * K, 0, dtype=torch.long, device=features.device)
    alphas = features.new_zeros(B * K, 0, L)
    locs = torch.zeros(B * K, 0, dtype=torch.long, device=features.device)
    offsets = (torch.arange(B, device=features.device) * K).unsqueeze(1)  # (B, 1)
    for t in range(max_len + 1):
        logits, h, c, alpha, loc = decoder.step(feats, projected, words, h, c, mode, generator)
        logp = logits.float().log_softmax(dim=-1)                         # (B*K, V)
        logp[:, [PAD_ID, START_ID] + ([UNK_ID] if ban_unk else [])] = float("-inf")
        if t == max_len:                                                  # out of room: end now
            logp[:, :END_ID] = logp[:, END_ID + 1:] = float("-inf")
            logp[:, END_ID] = 0.0
        # Frozen beams carry their score forward through <pad>.
        logp[finished] = float("-inf")
        logp[finished, PAD_ID] = 0.0
        candidates = (scores.view(-1, 1) + logp).view(B, K * V)          # (B, K*V)
        scores, flat = candidates.topk(K, dim=1)                          # (B, K)
        source = (offsets + flat // V).view(-1)                           # (B*K,) beam each extends
        words = (flat % V).view(-1)                                       # (B*K,)
        h, c = h[source], c[source]
        step_loc = loc[source] if loc is not None else torch.full_like(words, -1)  # (B*K,)
        tokens = torch.cat([tokens[source], words.unsqueeze(1)], dim=1)   # (B*K, t+1)
        alphas = torch.cat([alphas[source], alpha[source].unsqueeze(1)], dim=1)  # (B*K, t+1, L)
        locs = torch.cat([locs[source], step_loc.unsqueeze(1)], dim=1)    # (B*K, t+1)
        finished = finished[source] | (words == END_ID)
        if bool(finished.all()):
            break
    return _collect(tokens, scores, alphas, locs, B, K, length_norm)


def _collect(tokens, scores, alphas, locs, B, K, length_norm) -> list[list[Hypothesis]]:
    tokens, scores = tokens.cpu().numpy(), scores.float().cpu().numpy()
    alphas, locs = alphas.float().cpu().numpy(), locs.cpu().numpy()
    out = []
    for b in range(B):
        hyps = []
        for k in range(K):
            i = b * K + k
            if not np.isfinite(scores[b, k]):
                continue                                      # a beam that never had a live parent
            seq = tokens[i]
            ends = np.flatnonzero(seq == END_ID)
            n = int(ends[0]) if len(ends) else len(seq)
            hyps.append(Hypothesis(seq[:n].tolist(), float(scores[b, k]), alphas[i, :n], locs[i, :n],
                                   bool(len(ends))))
        key = (lambda hyp: hyp.normalized_score) if length_norm else (lambda hyp: hyp.score)
        out.append(sorted(hyps, key=key, reverse=True))
    return out
