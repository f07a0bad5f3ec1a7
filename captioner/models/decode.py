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
  looks at the device only every `CHECK_EVERY` steps to see whether all beams have ended. On
  CUDA each step runs as a captured CUDA graph, replayed (`models.graphed_search`).

Symbols: B images, K beams, N = B·K, L locations, V vocabulary, T steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from captioner.models.decoder import EXPECTED, AttentionDecoder, Joined
from captioner.models.vocab import END_ID, PAD_ID, START_ID, UNK_ID

CHECK_EVERY = 4  # fixed shapes: steps between looks at whether any beam still writes


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
        shapes: "packed" or "fixed" (see the module doc); default: fixed on a GPU, packed elsewhere.

    Returns:
        For each image, its K hypotheses, best first.
    """
    if beam_size < 1 or max_len < 1:
        raise ValueError(f"beam_size and max_len must be positive, got {beam_size} and {max_len}")
    B, K = features.size(0), beam_size
    s = _Search.start(decoder, features, K, max_len + 1, ban_unk)
    if (shapes or ("fixed" if features.is_cuda else "packed")) == "packed":
        steps = _packed(decoder, s, max_len, mode, generator, ban_unk)
    else:
        from captioner.models.graphed_search import fixed_steps

        steps = fixed_steps(decoder, s, max_len, mode, generator)
    return _collect(*_trace(s.word, s.parent, s.alpha, s.loc, steps), s.scores, B, K, length_norm, max_len)


def _packed(decoder: AttentionDecoder, s: _Search, max_len: int, mode: str, generator, ban_unk: bool) -> int:
    """The search stepping only the beams still writing; returns the steps taken."""
    B, K = s.scores.shape
    V = decoder.config.vocab_size
    offsets = (torch.arange(B, device=s.words.device) * K).unsqueeze(1)  # (B, 1)
    for t in range(max_len + 1):
        rows = s.writing.nonzero().squeeze(1)  # (n,) only the beams still writing take a step
        logits, alpha, loc = _step(decoder, s, rows, mode, generator)
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


def _step(decoder: AttentionDecoder, s: _Search, rows: torch.Tensor, mode: str, generator):
    """The decoder's step for the beams in `rows` (all of them without copying when all write)."""
    if rows.numel() == s.words.numel():
        logits, s.h, s.c, alpha, loc = decoder.step(s.feats, s.projected, s.words, s.h, s.c, mode, generator, s.joined)
        return logits, alpha, loc
    logits, h, c, alpha, loc = decoder.step(
        s.feats[rows], s.projected[rows], s.words[rows], s.h[rows], s.c[rows], mode, generator, s.joined
    )
    s.h, s.c = s.h.index_copy(0, rows, h), s.c.index_copy(0, rows, c)
    return logits, alpha, loc


def fixed_step(decoder: AttentionDecoder, s: _Search, t: torch.Tensor, max_len: int, mode: str, generator) -> None:
    """One step of every beam, its state updated in place: the same shapes at every step, no host read.

    Args:
        t: () long, the step (a tensor, so that a captured graph can count it).
    """
    B, K = s.scores.shape
    V = decoder.config.vocab_size
    logits, h, c, alpha, loc = decoder.step(s.feats, s.projected, s.words, s.h, s.c, mode, generator, s.joined)
    s.alpha.index_copy_(0, t.view(1), alpha.to(s.alpha.dtype).unsqueeze(0))
    if loc is not None:
        s.loc.index_copy_(0, t.view(1), loc.unsqueeze(0))
    ban = s.ban + torch.where(t == 0, s.ban_first, 0.0) + torch.where(t == max_len, s.only_end, 0.0)  # (V,)
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


def banned(*, first: bool, ban_unk: bool = True) -> list[int]:
    """The words a caption may not have at a step, in decoding and in SCST's sampling alike:
    <pad>, <start>, <unk> (unless allowed), and <end> as the first word (every caption has one)."""
    return [PAD_ID, START_ID] + ([UNK_ID] if ban_unk else []) + ([END_ID] if first else [])


def _allowed(step_logp: torch.Tensor, banned: list[int], *, last: bool) -> torch.Tensor:
    """A step's log-probabilities (n, V) with the banned words at -inf, and anything but <end> at
    the last step, where <end> keeps its own log-probability (a caption cut short pays its cost)."""
    step_logp[:, banned] = float("-inf")
    if last:
        step_logp[:, :END_ID] = step_logp[:, END_ID + 1 :] = float("-inf")
    return step_logp


@dataclass
class _Search:
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
    def start(cls, decoder: AttentionDecoder, features: torch.Tensor, K: int, T: int, ban_unk: bool) -> _Search:
        (B, L, _), device = features.shape, features.device
        N, V = B * K, decoder.config.vocab_size
        features = decoder.normalize(features)  # (B, L, D)
        h, c = (x.repeat_interleave(K, dim=0) for x in decoder.init_state(features))  # (N, H)
        scores = torch.full((B, K), float("-inf"), device=device)
        scores[:, 0] = 0.0  # one live beam at first: no duplicates
        masks = torch.zeros(4, V, device=device)  # ban, ban_first, only_end, pad_only
        masks[0, banned(first=False, ban_unk=ban_unk)] = float("-inf")
        masks[1, END_ID] = float("-inf")
        masks[2, :END_ID] = masks[2, END_ID + 1 :] = float("-inf")
        masks[3] = float("-inf")
        masks[3, PAD_ID] = 0.0
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


def _trace(hist_word, hist_parent, hist_alpha, hist_loc, steps: int):
    """Follow the back-pointers from the final beams: tokens (N, steps), α (N, steps, L), locations."""
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


def _collect(tokens, alphas, locs, scores, B, K, length_norm, max_len) -> list[list[Hypothesis]]:
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
        key = (lambda hyp: hyp.normalized_score) if length_norm else (lambda hyp: hyp.score)
        out.append(sorted(hyps, key=key, reverse=True))
    return out
