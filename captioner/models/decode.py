"""The one decoding routine: batched beam search (greedy is beam size 1 of it).

Used by validation, evaluation, the Python API, the web demo and the notebooks. Each image
keeps K beams; a beam that emits <end> is frozen (it extends only with <pad> at no cost) so all
beams advance in lock-step as tensors; at `max_len` words every unfinished beam is made to end,
so the search always terminates; <end> is not allowed as the first word, so every caption has at
least one (a barely trained model otherwise ranks the empty caption first, and the page, the API
and the metrics get nothing to show).

Cost per step: the decoder runs only on the beams still writing (not on finished beams, nor on
the K−1 empty beams of the first step); its LSTM inputs are one matrix product
(`AttentionDecoder.step`); the history is kept as back-pointers in buffers allocated once, and
the captions are traced back at the end, so nothing grows or is copied per step.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from captioner.models.decoder import EXPECTED, AttentionDecoder
from captioner.models.vocab import END_ID, PAD_ID, START_ID, UNK_ID


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
    N, T = B * K, max_len + 1                                              # beams, most steps
    if K < 1 or max_len < 1:
        raise ValueError(f"beam_size and max_len must be positive, got {K} and {max_len}")
    device = features.device
    features = decoder.normalize(features)                                # (B, L, D)
    feats = features.repeat_interleave(K, dim=0)                          # (N, L, D)
    projected = decoder.attention.project(features).repeat_interleave(K, dim=0)  # (N, L, A)
    h, c = (s.repeat_interleave(K, dim=0) for s in decoder.init_state(features))  # (N, H)
    words = torch.full((N,), START_ID, dtype=torch.long, device=device)
    scores = torch.full((B, K), float("-inf"), device=device)
    scores[:, 0] = 0.0                                       # one live beam at first: no duplicates
    finished = torch.zeros(N, dtype=torch.bool, device=device)
    offsets = (torch.arange(B, device=device) * K).unsqueeze(1)          # (B, 1)
    banned = [PAD_ID, START_ID] + ([UNK_ID] if ban_unk else [])
    # History as back-pointers: at step t beam r took word[t, r] after beam parent[t, r], whose
    # state gave α[t, parent] and location[t, parent]. Allocated once.
    hist_word = torch.zeros(T, N, dtype=torch.long, device=device)
    hist_parent = torch.zeros(T, N, dtype=torch.long, device=device)
    hist_alpha = features.new_zeros(T, N, L)
    hist_loc = torch.full((T, N), -1, dtype=torch.long, device=device)
    writing = scores.view(-1).isfinite()                                  # (N,) beams that need a step
    for t in range(T):
        rows = writing.nonzero().squeeze(1)                               # (n,)
        n = rows.numel()
        if n == N:
            logits, h, c, alpha, loc = decoder.step(feats, projected, words, h, c, mode, generator)
        else:                                                             # step only the writing beams
            logits, h_n, c_n, alpha, loc = decoder.step(feats[rows], projected[rows], words[rows],
                                                        h[rows], c[rows], mode, generator)
            h, c = h.index_copy(0, rows, h_n), c.index_copy(0, rows, c_n)
        hist_alpha[t].index_copy_(0, rows, alpha.to(hist_alpha.dtype))
        if loc is not None:
            hist_loc[t].index_copy_(0, rows, loc)
        step_logp = logits.float().log_softmax(dim=-1)                    # (n, V)
        step_logp[:, banned] = float("-inf")
        if t == 0:
            step_logp[:, END_ID] = float("-inf")                          # at least one word
        if t == max_len:                                                  # out of room: end now
            step_logp[:, :END_ID] = step_logp[:, END_ID + 1:] = float("-inf")
            step_logp[:, END_ID] = 0.0
        # Frozen beams carry their score forward through <pad>; beams without a step get -inf.
        logp = step_logp.new_full((N, V), float("-inf"))
        logp.index_copy_(0, rows, step_logp)
        logp[finished, PAD_ID] = 0.0
        candidates = (scores.view(-1, 1) + logp).view(B, K * V)          # (B, K*V)
        scores, flat = candidates.topk(K, dim=1)                          # (B, K)
        source = (offsets + flat // V).view(-1)                           # (N,) beam each extends
        words = (flat % V).view(-1)                                       # (N,)
        hist_word[t], hist_parent[t] = words, source
        h, c = h[source], c[source]
        finished = finished[source] | (words == END_ID)
        writing = ~finished & scores.view(-1).isfinite()
        if not bool(writing.any()):
            break
    return _collect(*_trace(hist_word, hist_parent, hist_alpha, hist_loc, t + 1), scores, B, K, length_norm)


def _trace(hist_word, hist_parent, hist_alpha, hist_loc, steps: int):
    """Follow the back-pointers from the final beams: tokens (N, steps), α (N, steps, L), locations."""
    N = hist_word.size(1)
    tokens = torch.empty(N, steps, dtype=torch.long, device=hist_word.device)
    alphas = hist_alpha.new_empty(N, steps, hist_alpha.size(2))
    locs = torch.empty_like(tokens)
    beam = torch.arange(N, device=hist_word.device)                      # (N,) beam at step t
    for t in reversed(range(steps)):
        parent = hist_parent[t, beam]                                     # (N,)
        tokens[:, t] = hist_word[t, beam]
        alphas[:, t] = hist_alpha[t, parent]
        locs[:, t] = hist_loc[t, parent]
        beam = parent
    return tokens, alphas, locs


def _collect(tokens, alphas, locs, scores, B, K, length_norm) -> list[list[Hypothesis]]:
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
