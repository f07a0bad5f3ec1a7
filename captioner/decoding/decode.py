"""The one decoding routine: batched beam search (greedy is beam size 1 of it).

Used by validation, evaluation, the Python API, the web demo and the notebooks. Each image
keeps K beams; a beam that emits <end> is frozen (it extends only with <pad> at no cost) so all
beams advance in lock-step as tensors; at `max_len` words every unfinished beam is made to end,
paying <end>'s own log-probability, so the search always terminates and a cut caption does not
outrank finished ones; <end> is not allowed as the first word, so every caption has at least one
(a barely trained model otherwise ranks the empty caption first, and the page, the API and the
metrics get nothing to show). The history is kept as back-pointers in buffers allocated once,
and the captions are traced back at the end, so nothing grows or is copied per step.

One search, two shapes (the same captions and maps: tests):
- packed (CPUs): the decoder runs only on the beams still writing (not on finished beams, nor on
  the K−1 empty beams of the first step), and the search stops as soon as none writes;
- fixed (GPUs): every beam steps every time, a finished beam's step thrown away, and the host
  looks at the device only every `CHECK_EVERY` steps to see whether all beams have ended
  (`decoding.search_state`). Where a caller asks (`compiled`), each block of steps is compiled, and on
  a GPU replayed as a CUDA graph.

Symbols: B images, K beams, N = B·K, L locations, V vocabulary, T steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from captioner.decoding.search_state import Search, banned, fixed_length, fixed_search
from captioner.models.attention import EXPECTED
from captioner.models.decoder import AttentionDecoder
from captioner.models.vocab import END_ID, PAD_ID


@dataclass
class Hypothesis:
    """One decoded caption."""

    tokens: list[int]  # word ids, without <start> and <end>
    score: float  # sum of log-probabilities, <end> included
    attention: np.ndarray  # (len(tokens), L): α used to produce each word
    locations: np.ndarray  # (len(tokens),): chosen location per word (-1 for expected context)
    ended: bool  # False when cut at max_len: <end> was the only word allowed

    @property
    def normalized_score(self) -> float:
        return self.score / (len(self.tokens) + 1)


@torch.inference_mode()
def beam_search(
    decoder: AttentionDecoder,
    features: torch.Tensor,
    *,
    beam_size: int = 3,
    max_len: int = 20,
    length_norm: bool = False,
    ban_unk: bool = True,
    mode: str = EXPECTED,
    generator: torch.Generator | None = None,
    shapes: str | None = None,
    compiled: bool = False,
    sharpness: float | None = None,
) -> list[list[Hypothesis]]:
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
        shapes: "packed" or "fixed" (see the module doc); default: fixed on a GPU or `compiled`, else packed.
        compiled: run the fixed shapes' blocks of steps compiled (`decoding.search_state`), which earns back
            its compile only over thousands of searches (`compiled.earns_back`).
        sharpness: k of the maps softmax(k e_t) (None: the model's `decode_sharpness`).

    Returns:
        For each image, its K hypotheses, best first.
    """
    if beam_size < 1 or max_len < 1:
        raise ValueError(f"beam_size and max_len must be positive, got {beam_size} and {max_len}")
    if (shapes or ("fixed" if features.is_cuda or compiled else "packed")) == "packed":
        s = Search.start(decoder, features, beam_size, max_len + 1, ban_unk)
        steps = _packed(decoder, s, max_len, mode, generator, ban_unk, sharpness)
    else:
        s = Search.start(decoder, features, beam_size, fixed_length(max_len), ban_unk, static=compiled)
        steps = fixed_search(decoder, s, max_len, mode, generator, sharpness, compiled=compiled)
    # The history goes to the host in one copy each, and is traced back there.
    history = (x[:steps].cpu() for x in (s.word, s.parent, s.alpha, s.loc))
    found = hypotheses(*_trace(*history), s.scores, max_len)
    key = (lambda hyp: hyp.normalized_score) if length_norm else (lambda hyp: hyp.score)
    return [sorted(hyps, key=key, reverse=True) for hyps in found]


def _packed(decoder: AttentionDecoder, s: Search, max_len: int, mode: str, generator, ban_unk: bool, sharpness) -> int:
    """The search stepping only the beams still writing; returns the steps taken."""
    B, K = s.scores.shape
    V = decoder.config.vocab_size
    offsets = (torch.arange(B, device=s.words.device) * K).unsqueeze(1)  # (B, 1)
    for t in range(max_len + 1):
        rows = s.writing.nonzero().squeeze(1)  # (n,) only the beams still writing take a step
        logits, alpha, loc = _step(decoder, s, rows, mode, generator, sharpness)
        s.alpha[t].index_copy_(0, rows, alpha.to(s.alpha.dtype))
        if loc is not None:
            s.loc[t].index_copy_(0, rows, loc)
        step_logp = _allowed(
            logits.float().log_softmax(dim=-1), banned(first=t == 0, ban_unk=ban_unk), last=t == max_len
        )
        # Frozen beams carry their score forward through <pad>; beams without a step get -inf.
        logp = step_logp.new_full((s.words.size(0), V), float("-inf"))  # (N, V)
        logp.index_copy_(0, rows, step_logp)
        logp[s.finished, PAD_ID] = 0.0
        s.scores, flat = (s.scores.view(-1, 1) + logp).view(B, K * V).topk(K, dim=1)  # (B, K)
        source = (offsets + flat // V).view(-1)  # (N,) the beam each extends
        s.words = (flat % V).view(-1)  # (N,)
        s.word[t], s.parent[t] = s.words, source
        s.h, s.c = s.h[source], s.c[source]
        s.finished = s.finished[source] | (s.words == END_ID)
        s.writing = ~s.finished & s.scores.view(-1).isfinite()
        if not bool(s.writing.any()):
            break
    return t + 1


def _step(decoder: AttentionDecoder, s: Search, rows: torch.Tensor, mode: str, generator, sharpness):
    """The decoder's step for the beams in `rows` (all of them without copying when all write)."""
    if rows.numel() == s.words.numel():
        logits, s.h, s.c, alpha, loc = decoder.step(
            s.feats, s.projected, s.words, s.h, s.c, mode, generator, s.joined, sharpness
        )
        return logits, alpha, loc
    logits, h, c, alpha, loc = decoder.step(
        s.feats[rows], s.projected[rows], s.words[rows], s.h[rows], s.c[rows], mode, generator, s.joined, sharpness
    )
    s.h, s.c = s.h.index_copy(0, rows, h), s.c.index_copy(0, rows, c)
    return logits, alpha, loc


def _allowed(step_logp: torch.Tensor, banned: list[int], *, last: bool) -> torch.Tensor:
    """A step's log-probabilities (n, V) with the banned words at -inf, and anything but <end> at
    the last step, where <end> keeps its own log-probability (a caption cut short pays its cost)."""
    step_logp[:, banned] = float("-inf")
    if last:
        step_logp[:, :END_ID] = step_logp[:, END_ID + 1 :] = float("-inf")
    return step_logp


def _trace(hist_word, hist_parent, hist_alpha, hist_loc):
    """Follow the back-pointers (steps, N) from the final beams: tokens (N, steps), α (N, steps, L), locations."""
    steps = hist_word.size(0)
    N = hist_word.size(1)
    tokens = torch.empty(N, steps, dtype=torch.long, device=hist_word.device)
    alphas = hist_alpha.new_empty(N, steps, hist_alpha.size(2))
    locs = torch.empty_like(tokens)
    beam = torch.arange(N, device=hist_word.device)  # (N,) beam at step t
    for t in reversed(range(steps)):
        parent = hist_parent[t, beam]  # (N,)
        tokens[:, t] = hist_word[t, beam]
        alphas[:, t] = hist_alpha[t, parent]
        locs[:, t] = hist_loc[t, parent]
        beam = parent
    return tokens, alphas, locs


def hypotheses(tokens, alphas, locs, scores, max_len: int) -> list[list[Hypothesis]]:
    """Each image's captions, in row order, from the rows' tokens (N, T), maps (N, T, L), locations (N, T)
    and scores (B, K); a row with no finite score (a beam that never had a live parent) is left out."""
    B, K = scores.shape
    tokens, scores = tokens.cpu().numpy(), scores.float().cpu().numpy()
    alphas, locs = alphas.float().cpu().numpy(), locs.cpu().numpy()
    out = []
    for b in range(B):
        hyps = []
        for k in range(K):
            i = b * K + k
            if not np.isfinite(scores[b, k]):
                continue  # a beam that never had a live parent
            seq = tokens[i]
            ends = np.flatnonzero(seq == END_ID)
            n = int(ends[0]) if len(ends) else len(seq)
            # A caption of max_len words had <end> forced on it: it was cut, not ended.
            hyps.append(Hypothesis(seq[:n].tolist(), float(scores[b, k]), alphas[i, :n], locs[i, :n], n < max_len))
        out.append(hyps)
    return out
