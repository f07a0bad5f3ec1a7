"""The beam search, written once over either runtime's arrays: PyTorch's tensors (`decoding.decode`, the
decoder's step on any device) or NumPy's (`serve.onnx`, the exported step on onnxruntime, without torch).

Each image keeps K beams; a beam that emits <end> is frozen (it extends only with <pad> at no cost) so all
beams advance in lock-step as arrays; at `max_len` words every unfinished beam is made to end, paying
<end>'s own log-probability, so the search always terminates and a cut caption does not outrank finished
ones; <end> is not allowed as the first word, so every caption has at least one (a barely trained model
otherwise ranks the empty caption first, and the page, the API and the metrics get nothing to show). The
step runs only on the beams still writing (not on finished beams, nor on the K−1 empty beams of the first
step), and the search stops as soon as none writes. The history is kept as back-pointers in arrays made
once, and the captions are traced back on the host at the end, so nothing grows or is copied per step.

Only NumPy is imported here: a runtime brings its arrays (`Arrays`) and its step (`Step`).

Symbols: B images, K beams, N = B·K, L locations, V vocabulary, T steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

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


class Arrays(Protocol):
    """What the search needs of an array library beyond indexing and arithmetic, which NumPy's arrays and
    PyTorch's tensors share."""

    def full(self, shape: tuple, value, dtype: str) -> Any:  # dtype: "float", "long" or "bool"
        ...

    def arange(self, n: int) -> Any: ...

    def topk(self, x, k: int) -> tuple[Any, Any]:  # the k largest of each row (B, n), largest first
        ...

    def flatnonzero(self, mask) -> Any: ...

    def isfinite(self, x) -> Any: ...


class Step(Protocol):
    """A runtime's decoder step over the N = B·K beams of a search (their features held inside)."""

    arrays: Arrays
    beams: int  # K
    images: int  # B
    vocabulary: int  # V
    locations: int  # L

    def start(self) -> tuple[Any, Any]:
        """h_0, c_0 of every beam (N, H)."""

    def __call__(self, rows, words, h, c) -> tuple[Any, Any, Any, Any, Any]:
        """The step of the beams in `rows` (n,) (None: all N) from their last words (n,) and states (n, H):
        log-probabilities (n, V) in float32, h and c (n, H), α (n, L), and the locations (n,) or None."""


class NumpyArrays:
    """`Arrays` of NumPy."""

    DTYPES = {"float": np.float32, "long": np.int64, "bool": np.bool_}

    def full(self, shape, value, dtype):
        return np.full(shape, value, dtype=self.DTYPES[dtype])

    def arange(self, n):
        return np.arange(n)

    def topk(self, x, k):
        # Argsort over the rows' -x, stable: of equal values the first, as a sorted top-k takes them.
        order = np.argsort(-x, axis=1, kind="stable")[:, :k]
        return np.take_along_axis(x, order, axis=1), order

    def flatnonzero(self, mask):
        return np.flatnonzero(mask)

    def isfinite(self, x):
        return np.isfinite(x)


def search(step: Step, max_len: int, ban_unk: bool = True, length_norm: bool = False) -> list[list[Hypothesis]]:
    """The captions of a batch of images: for each, its K hypotheses, best first.

    Args:
        step: the runtime's decoder step over the batch's beams.
        max_len: most words per caption (before <end>).
        ban_unk: never emit <unk>.
        length_norm: rank finished captions by score per token instead of total score.
    """
    xp, B, K, V, L = step.arrays, step.images, step.beams, step.vocabulary, step.locations
    N, T = B * K, max_len + 1
    h, c = step.start()  # (N, H)
    words = xp.full((N,), START_ID, "long")
    scores = xp.full((B, K), float("-inf"), "float")
    scores[:, 0] = 0.0  # one live beam at first: no duplicates
    finished = xp.full((N,), False, "bool")  # beams that emitted <end>
    writing = xp.isfinite(scores.reshape(-1))  # beams that take the next step
    word, parent, loc = xp.full((T, N), 0, "long"), xp.full((T, N), 0, "long"), xp.full((T, N), -1, "long")
    alpha = xp.full((T, N, L), 0.0, "float")  # at step t beam r took word[t, r] after beam parent[t, r]
    offsets = (xp.arange(B) * K).reshape(B, 1)  # each image's first beam
    for t in range(T):
        rows = xp.flatnonzero(writing)  # (n,) only the beams still writing take a step
        every = len(rows) == N
        step_logp, h_rows, c_rows, alpha_rows, loc_rows = step(
            None if every else rows, words[rows], h if every else h[rows], c if every else c[rows]
        )
        if every:
            h, c = h_rows, c_rows
        else:
            h[rows], c[rows] = h_rows, c_rows
        alpha[t][rows] = alpha_rows
        if loc_rows is not None:
            loc[t][rows] = loc_rows
        step_logp[:, banned(first=t == 0, ban_unk=ban_unk)] = float("-inf")
        if t == max_len:  # only <end> is left, at its own cost
            step_logp[:, :END_ID] = float("-inf")
            step_logp[:, END_ID + 1 :] = float("-inf")
        # Frozen beams carry their score forward through <pad>; beams without a step get -inf.
        logp = xp.full((N, V), float("-inf"), "float")  # (N, V)
        logp[rows] = step_logp
        logp[finished, PAD_ID] = 0.0
        scores, flat = xp.topk((scores.reshape(-1, 1) + logp).reshape(B, K * V), K)  # (B, K)
        source = (offsets + flat // V).reshape(-1)  # (N,) the beam each extends
        words = (flat % V).reshape(-1)  # (N,)
        word[t], parent[t] = words, source
        h, c = h[source], c[source]
        finished = finished[source] | (words == END_ID)
        writing = ~finished & xp.isfinite(scores.reshape(-1))
        if not bool(writing.any()):
            break
    history = (host(x[: t + 1]) for x in (word, parent, alpha, loc))
    return best_first(hypotheses(*trace(*history), host(scores), max_len), length_norm)


def host(x) -> np.ndarray:
    """A runtime's array as a NumPy array on the host (a tensor: copied from its device)."""
    return x.cpu().numpy() if hasattr(x, "cpu") else np.asarray(x)


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
    and scores (B, K), arrays of either runtime; a row with no finite score (a beam that never had a live
    parent) is left out."""
    tokens, alphas, locs = host(tokens), host(alphas).astype(np.float32), host(locs)
    scores = host(scores).astype(np.float32)
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
