"""The state of a batched search and its fixed-shape steps.

A fixed-shape search steps every beam every time, in blocks of `CHECK_EVERY` steps, after each of which the host looks
whether any beam still writes. A block is a pure function of the search's state, so that
`torch.compile(mode="reduce-overhead")` can replay it as a CUDA graph, whose outputs a later replay overwrites. The
step, the last step and the sharpness are tensors, not constants of the compiled code, so searches of any length and
sharpness share it; its large inputs sit in `static` buffers, which a CUDA graph does not copy at every replay. Searches
that sample locations draw from a caller's generator, which compiled code cannot take, and run eagerly.

Symbols: B images, K beams, N = B·K, L locations, V vocabulary, T steps.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import torch

from captioner.compiled import Compiled, compile_mode, no_autocast
from captioner.decoding.beams import extend, masks
from captioner.models.decoder import SAMPLE, AttentionDecoder, Joined
from captioner.models.vocab import START_ID

CHECK_EVERY = 4  # fixed shapes: steps between looks at whether any beam still writes
_held = threading.local()  # each thread's buffers for its compiled searches' inputs (`static`)


def fixed_length(max_len: int) -> int:
    """The steps a fixed-shape search has room for: max_len words and <end>, in whole blocks of
    `CHECK_EVERY` (after <end> is forced at max_len every beam writes only <pad>, free)."""
    return -(-(max_len + 1) // CHECK_EVERY) * CHECK_EVERY


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
    def start(
        cls, decoder: AttentionDecoder, features: torch.Tensor, K: int, T: int, *, static: bool = False
    ) -> Search:
        """A search of K beams an image, with room for T steps; its inputs in `static` buffers where asked."""
        (B, L, _), device = features.shape, features.device
        N, V = B * K, decoder.config.vocab_size
        place = static_copy if static else lambda name, t: t
        features, projected, h, c = decoder.start(features)  # (B, L, D), (B, L, A), (B, H) twice
        scores = torch.full((B, K), float("-inf"), device=device)
        scores[:, 0] = 0.0  # one live beam at first: no duplicates
        return cls(
            place("features", _beams(features, K)),
            place("projected", _beams(projected, K)),
            _beams(h, K),
            _beams(c, K),
            torch.full((N,), START_ID, dtype=torch.long, device=device),
            scores,
            torch.zeros(N, dtype=torch.bool, device=device),
            scores.view(-1).isfinite(),
            torch.zeros(T, N, dtype=torch.long, device=device),
            torch.zeros(T, N, dtype=torch.long, device=device),
            features.new_zeros(T, N, L),
            torch.full((T, N), -1, dtype=torch.long, device=device),
            Joined(*(place(f"joined.{name}", w) for name, w in decoder.joined()._asdict().items())),
            *(place(f"mask.{i}", m) for i, m in enumerate(torch.from_numpy(masks(V)).to(device))),
            (torch.arange(B, device=device) * K).unsqueeze(1),
        )


def _beams(x: torch.Tensor, K: int) -> torch.Tensor:
    """(B, ...) → (B·K, ...): each image's row once for each of its beams."""
    return x.repeat_interleave(K, dim=0)


def static_copy(name: str, t: torch.Tensor) -> torch.Tensor:
    """`t` copied into this thread's buffer `name`, which keeps its place in memory from search to search (a
    larger `t` grows it, once): the compiled block reads it there as a static input, which a CUDA graph does
    not copy at each replay."""
    held = _held.__dict__.setdefault("buffers", {})
    key = (name, t.device, t.dtype, t.shape[1:])
    buffer = held.get(key)
    if buffer is None or buffer.size(0) < t.size(0):
        with torch.inference_mode(False):  # a buffer that searches in inference mode and out of it can fill
            buffer = held[key] = torch.empty_like(t)
    view = buffer[: t.size(0)]
    view.copy_(t)
    torch._dynamo.mark_static_address(view, guard=False)
    return view


def step_logits(
    decoder: AttentionDecoder, s: Search, words, h, c, t: torch.Tensor, last: torch.Tensor, mode, generator, sharpness
):
    """The decoder's step for every row of `s` at step t (`last`: the step at which only <end> is left;
    both () long): logits (N, V), h, c, α, locations or None, and what the step adds to the log-probabilities (V,)."""
    logits, h, c, alpha, loc = decoder.step(s.feats, s.projected, words, h, c, mode, generator, s.joined, sharpness)
    ban = s.ban + torch.where(t == 0, s.ban_first, 0.0) + torch.where(t == last, s.only_end, 0.0)  # (V,)
    return logits, h, c, alpha, loc, ban


def fixed_block(
    decoder: AttentionDecoder, s: Search, t: torch.Tensor, last: torch.Tensor, mode: str, generator, sharpness
):
    """`CHECK_EVERY` steps of every beam from `s`'s state, which is not changed, with no host read:
    the new (h, c, words, scores, finished, writing) and the steps' (word, parent, α, location), each
    (CHECK_EVERY, N, ...), the locations None for the expected context."""
    h, c, words, scores, finished = s.h, s.c, s.words, s.scores, s.finished
    history = []
    for i in range(CHECK_EVERY):
        logits, h, c, alpha, loc, ban = step_logits(decoder, s, words, h, c, t + i, last, mode, generator, sharpness)
        logp = logits.float().log_softmax(dim=-1) + ban  # (N, V)
        logp = torch.where(finished.unsqueeze(1), s.pad_only, logp)  # frozen beams go on through <pad>, free
        scores, source, words, finished = extend(scores, logp, finished, s.offsets, torch.topk)
        h, c = h.index_select(0, source), c.index_select(0, source)  # (N, H)
        history.append((words, source, alpha.to(s.feats.dtype), loc))
    writing = ~finished & scores.view(-1).isfinite()  # (N,)
    word, parent, alpha, loc = zip(*history)
    loc = None if loc[0] is None else torch.stack(loc)
    return (h, c, words, scores, finished, writing), (torch.stack(word), torch.stack(parent), torch.stack(alpha), loc)


@functools.cache
def compiled_block(mode: str) -> Compiled:
    """`fixed_block` compiled in `mode`, for every search of the process (one compile per shape)."""
    return Compiled(fixed_block, "the search's block of steps", mode=mode, dynamic=None, limit=16)


def fixed_search(
    decoder: AttentionDecoder, s: Search, max_len: int, mode: str, generator, sharpness, *, compiled: bool
) -> int:
    """Run the fixed-shape search on `s` (made `static` where `compiled`), whose fields then hold the results;
    its history has room for whole blocks (`fixed_length`). Returns the steps taken."""
    T, device = s.word.size(0), s.words.device
    if T % CHECK_EVERY:
        raise ValueError(f"a fixed-shape search steps in blocks of {CHECK_EVERY}: room for {T} steps")
    t = torch.zeros((), dtype=torch.long, device=device)
    last = torch.full((), max_len, dtype=torch.long, device=device)
    sharpness = torch.full((), sharpness or decoder.config.decode_sharpness, device=device)
    block = fixed_block
    if compiled and mode != SAMPLE:
        block, generator = compiled_block(compile_mode(device, graphs=True)), None
    with no_autocast(device):  # in the model's own precision, as at test time
        for k in range(0, T, CHECK_EVERY):
            state, (word, parent, alpha, loc) = block(decoder, s, t, last, mode, generator, sharpness)
            for name, value in zip(("h", "c", "words", "scores", "finished", "writing"), state):
                getattr(s, name).copy_(value)  # out of the compiled code's memory, which its next replay reuses
            s.word[k : k + CHECK_EVERY] = word
            s.parent[k : k + CHECK_EVERY] = parent
            s.alpha[k : k + CHECK_EVERY] = alpha
            if loc is not None:
                s.loc[k : k + CHECK_EVERY] = loc
            t.add_(CHECK_EVERY)
            if k + CHECK_EVERY < T and not bool(s.writing.any()):
                return k + CHECK_EVERY
    return T
