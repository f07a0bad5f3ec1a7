"""The beam search over NumPy arrays, for both runtimes (PyTorch's step on the CPU shares its tensors'
memory with them); the fixed-shape search a GPU compiles extends its beams by the same rule and masks.

Each image keeps K beams; a beam that emits <end> is frozen (it extends only with <pad> at no cost) so all beams advance
in lock-step as arrays; at `max_len` words every unfinished beam is made to end, paying <end>'s own log-probability, so
the search always terminates and a cut caption does not outrank finished ones; <end> is not allowed as the first word,
so every caption has at least one (a barely trained model otherwise ranks the empty caption first, and the page, the API
and the metrics get nothing to show). The step runs only on the beams still writing (not on finished beams, nor on the
K−1 empty beams of the first step), and the search stops as soon as none writes. The history is kept as back-pointers in
arrays made once and traced back at the end, so nothing grows or is copied per step.

Symbols: B images, K beams, N = B·K, L locations, V vocabulary, T steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from captioner.decoding.settings import Decoding
from captioner.models.vocab import END_ID, PAD_ID, START_ID, UNK_ID


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


def banned(*, first: bool, ban_unk: bool = True) -> list[int]:
    """The words a caption may not have at a step, in decoding and in SCST's sampling alike:
    <pad>, <start>, <unk> (unless allowed), and <end> as the first word (every caption has one)."""
    return [PAD_ID, START_ID] + ([UNK_ID] if ban_unk else []) + ([END_ID] if first else [])


def masks(V: int) -> np.ndarray:
    """What a step adds to its log-probabilities (4, V): the banned words' -inf at every step, <end>'s at the
    first, all but <end>'s at the last (`max_len`); and a frozen beam's row, only <pad>, free."""
    out = np.zeros((4, V), dtype=np.float32)
    out[0, banned(first=False)] = -np.inf
    out[1, END_ID] = -np.inf
    out[2, :END_ID] = out[2, END_ID + 1 :] = -np.inf
    out[3] = -np.inf
    out[3, PAD_ID] = 0.0
    return out


def extend(scores, logp, finished, offsets, topk):
    """Each image's K best extensions of its beams, on NumPy's arrays or PyTorch's tensors alike: scores
    (B, K) and the beams' log-probabilities (N, V) → the new scores (B, K), the beam each extends (N,), its
    word (N,) and the beams that have ended (N,). `offsets` (B, 1) are the images' first beams; `topk` is
    the runtime's: the k largest of each row, largest first, with their columns."""
    (B, K), V = scores.shape, logp.shape[1]
    scores, flat = topk((scores.reshape(-1, 1) + logp).reshape(B, K * V), K)  # (B, K)
    source = (offsets + flat // V).reshape(-1)  # (N,)
    words = (flat % V).reshape(-1)  # (N,)
    return scores, source, words, finished[source] | (words == END_ID)


def topk(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    # A stable sort of -x: of equal values the first, as PyTorch's sorted top-k takes them.
    order = np.argsort(-x, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(x, order, axis=1), order


def search(step, max_len: int, length_norm: bool = Decoding.length_norm) -> list[list[Hypothesis]]:
    """The captions of a batch of images: for each, its K hypotheses, best first. `max_len` counts the words
    before <end>; `length_norm` ranks them by score per token.

    `step` is a runtime's decoder step over the N = B·K beams, their features held inside (`images` B, `beams`
    K, `vocabulary` V, `locations` L): `step.start()` gives h_0, c_0 (N, H), and `step(rows, words, h, c)` the
    step of the beams in `rows` (n,) (None: all N) from their last words (n,) and states (n, H): their
    log-probabilities (n, V) and α (n, L) in float32, h and c (n, H), and the locations (n,) or None.
    """
    B, K, V, L = step.images, step.beams, step.vocabulary, step.locations
    N, T = B * K, max_len + 1
    ban, ban_first, only_end, _ = masks(V)
    h, c = step.start()  # (N, H)
    words = np.full(N, START_ID, dtype=np.int64)
    scores = np.full((B, K), -np.inf, dtype=np.float32)
    scores[:, 0] = 0.0  # one live beam at first: no duplicates
    finished = np.zeros(N, dtype=bool)  # beams that emitted <end>
    writing = np.isfinite(scores.reshape(-1))  # beams that take the next step
    word, parent, loc = np.zeros((T, N), np.int64), np.zeros((T, N), np.int64), np.full((T, N), -1, np.int64)
    alpha = np.zeros((T, N, L), dtype=np.float32)  # at step t beam r took word[t, r] after beam parent[t, r]
    offsets = np.arange(B).reshape(B, 1) * K  # each image's first beam
    for t in range(T):
        rows = np.flatnonzero(writing)  # (n,) only the beams still writing take a step
        every = len(rows) == N
        step_logp, h_rows, c_rows, alpha_rows, loc_rows = step(
            None if every else rows, words[rows], h if every else h[rows], c if every else c[rows]
        )
        alpha[t][rows] = alpha_rows
        if every:
            h, c = h_rows, c_rows
        else:
            h[rows], c[rows] = h_rows, c_rows
        if loc_rows is not None:
            loc[t][rows] = loc_rows
        step_logp += ban + (ban_first if t == 0 else 0.0) + (only_end if t == max_len else 0.0)
        # Frozen beams carry their score forward through <pad>; beams without a step get -inf.
        logp = np.full((N, V), -np.inf, dtype=np.float32)  # (N, V)
        logp[rows] = step_logp
        logp[finished, PAD_ID] = 0.0
        scores, source, words, finished = extend(scores, logp, finished, offsets, topk)
        word[t], parent[t] = words, source
        h, c = h[source], c[source]
        writing = ~finished & np.isfinite(scores.reshape(-1))
        if not writing.any():
            break
    history = trace(word[: t + 1], parent[: t + 1], alpha[: t + 1], loc[: t + 1])
    return best_first(hypotheses(*history, scores, max_len), length_norm)


def trace(word: np.ndarray, parent: np.ndarray, alpha: np.ndarray, loc: np.ndarray):
    """Follow the back-pointers (T, N) from the final beams: tokens (N, T), α (N, T, L), locations (N, T)."""
    steps, N = word.shape
    tokens, locs = np.empty((N, steps), dtype=np.int64), np.empty((N, steps), dtype=np.int64)
    alphas = np.empty((N, steps, alpha.shape[2]), dtype=alpha.dtype)
    beam = np.arange(N)  # (N,) beam at step t
    for t in reversed(range(steps)):
        up = parent[t, beam]  # (N,)
        tokens[:, t], alphas[:, t], locs[:, t] = word[t, beam], alpha[t, up], loc[t, up]
        beam = up
    return tokens, alphas, locs


def hypotheses(tokens, alphas, locs, scores, max_len: int) -> list[list[Hypothesis]]:
    """Each image's captions, in row order, from the rows' tokens (N, T), maps (N, T, L), locations (N, T)
    and scores (B, K), NumPy arrays; a row with no finite score is left out."""
    alphas, scores = alphas.astype(np.float32), scores.astype(np.float32)
    B, K = scores.shape
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


def best_first(found: list[list[Hypothesis]], length_norm: bool) -> list[list[Hypothesis]]:
    """Each image's hypotheses by score (per token with `length_norm`), best first."""
    key = (lambda hyp: hyp.normalized_score) if length_norm else (lambda hyp: hyp.score)
    return [sorted(hyps, key=key, reverse=True) for hyps in found]
