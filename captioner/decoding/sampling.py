"""Sampled captions: each word drawn from the decoder's distribution, with temperature, top-k and top-p.

Every image gets n captions, drawn independently, each with the map the decoder drew for each of its words. The words a
beam search bans are banned here too, and at `max_len` words <end> is the only word left, so a temperature of 0 (always
the likeliest word), or top-k = 1, writes the greedy caption: beam search at one beam (a test holds them equal).

The steps are the beam search's fixed-shape ones, run eagerly, on a GPU too: each draws from the
caller's seeded generator, which compiled code cannot take.

Symbols: B images, n samples, N = B·n, L locations, V vocabulary, T steps.
"""

from __future__ import annotations

import torch

from captioner.decoding.beams import Hypothesis, hypotheses
from captioner.decoding.search_state import CHECK_EVERY, Search, step_logits
from captioner.models.decoder import EXPECTED, AttentionDecoder, sample_from
from captioner.models.vocab import END_ID, PAD_ID


@torch.inference_mode()
def sample_captions(
    decoder: AttentionDecoder,
    features: torch.Tensor,
    *,
    n: int = 1,
    max_len: int = 20,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    mode: str = EXPECTED,
    generator: torch.Generator | None = None,
    sharpness: float | None = None,
) -> list[list[Hypothesis]]:
    """Draw n captions for each image of the features (B, L, D), each word from softmax(logits / temperature)
    (0: the likeliest word) among the `top_k` likeliest (0: all) that hold `top_p` of the probability; the
    words, and mode "sample"'s locations, drawn from `generator`. `max_len`, `mode` and `sharpness` are as
    `decoding.decode.beam_search` takes them. A sample's score is the decoder's log-probability of its words
    and <end> (not the tempered or truncated one).
    """
    if n < 1 or max_len < 1:
        raise ValueError(f"n and max_len must be positive, got {n} and {max_len}")
    s = Search.start(decoder, features, n, max_len + 1)
    s.scores.zero_()  # every row is a caption of its own from the start
    s.writing.fill_(True)
    t = torch.zeros((), dtype=torch.long, device=features.device)
    last = torch.full((), max_len, dtype=torch.long, device=features.device)
    draw = Draw(temperature, top_k, top_p)
    steps = max_len + 1
    for k in range(max_len + 1):
        sampling_step(decoder, s, t, last, draw, mode, generator, sharpness)
        if (k + 1) % CHECK_EVERY == 0 and not bool(s.writing.any()):  # the host looks every few steps
            steps = k + 1
            break
    history = (s.word[:steps].T, s.alpha[:steps].transpose(0, 1), s.loc[:steps].T, s.scores)  # rows never reorder
    return hypotheses(*(x.cpu().numpy() for x in history), max_len)


class Draw:
    """How a word is drawn from a step's logits: temperature, then top-k, then top-p."""

    def __init__(self, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
        self.temperature, self.top_k, self.top_p = float(temperature), int(top_k), float(top_p)

    def __call__(self, logits: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """One word per row (N,) from logits (N, V), banned words already at -inf."""
        if self.temperature == 0 or self.top_k == 1:
            return logits.argmax(dim=1)  # (N,)
        logits = logits / self.temperature  # (N, V)
        if 0 < self.top_k < logits.size(1):
            kth = logits.topk(self.top_k, dim=1).values[:, -1:]  # (N, 1)
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1:
            ordered, order = logits.sort(dim=1, descending=True)  # (N, V)
            p = ordered.softmax(dim=1)
            # A word is left out when the likelier words before it already hold top_p: the first never is.
            out = (p.cumsum(dim=1) - p) >= self.top_p  # (N, V)
            logits = logits.scatter(1, order, ordered.masked_fill(out, float("-inf")))
        return sample_from(logits.softmax(dim=1), generator)  # (N,)


def sampling_step(
    decoder: AttentionDecoder,
    s: Search,
    t: torch.Tensor,
    last: torch.Tensor,
    draw: Draw,
    mode: str,
    generator: torch.Generator | None,
    sharpness: float | None = None,
) -> None:
    """One word for every row, the state updated in place: the same shapes at every step, no host read."""
    logits, h, c, alpha, loc, ban = step_logits(decoder, s, s.words, s.h, s.c, t, last, mode, generator, sharpness)
    s.alpha.index_copy_(0, t.view(1), alpha.to(s.alpha.dtype).unsqueeze(0))
    if loc is not None:
        s.loc.index_copy_(0, t.view(1), loc.unsqueeze(0))
    logits = logits.float()  # (N, V)
    words = torch.where(s.finished, PAD_ID, draw(logits + ban, generator))  # (N,) a finished row writes <pad>
    logp = logits.log_softmax(dim=1).gather(1, words.unsqueeze(1)).squeeze(1)  # (N,) as the beams score it
    s.scores.view(-1).add_(torch.where(s.finished, 0.0, logp))
    s.words.copy_(words)
    s.word.index_copy_(0, t.view(1), words.unsqueeze(0))
    s.h.copy_(h)
    s.c.copy_(c)
    s.finished.logical_or_(words == END_ID)
    s.writing.copy_(~s.finished)
    t.add_(1)
