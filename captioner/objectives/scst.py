"""Self-critical sequence training (Rennie et al., CVPR 2017): optimise CIDEr-D directly.

For each image, n captions w^1..w^n are sampled from the model p(w|a); each earns a reward r(w)
(CIDEr-D against the image's training references), and the REINFORCE gradient with a baseline b,
    ∇L = −(1/n) Σ_k (r(w^k) − b_k) ∇ log p(w^k | a).
The baseline is the reward of the greedy caption (Rennie's "self-critical") or, the default, the
mean reward of the image's other n − 1 samples (Luo 2020), which needs no extra decoding and is
still independent of the sample it judges. An epoch is one pass over the training images.
Symbols: B images, n samples per image, N = B·n captions, L locations, D feature size, T steps, V vocabulary.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Annotated, Literal, NamedTuple

import numpy as np
import torch

from captioner.compiled import no_autocast
from captioner.data.dataset import CaptionData
from captioner.decoding.beams import banned
from captioner.decoding.decode import beam_search
from captioner.decoding.search_state import CHECK_EVERY
from captioner.errors import OptionError
from captioner.models.decoder import EXPECTED, SAMPLE, AttentionDecoder, sample_from
from captioner.models.vocab import END_ID, PAD_ID, START_ID
from captioner.objectives.cider import NgramScorer, References, cached_document_frequency
from captioner.objectives.objective import LOG_EPS
from captioner.objectives.terms import Context, Term

BASELINES = ("mean", "greedy")
LR = 5e-5  # SCST's default learning rate, ruotianluo/self-critical.pytorch's


@dataclass(frozen=True)
class ScstConfig:
    """Self-critical training (`--objective scst`); part of TrainConfig, so saved in every checkpoint."""

    samples: Annotated[int, "scst: captions sampled per image"] = 5
    baseline: Annotated[
        Literal["mean", "greedy"],
        "--scst-baseline",
        "scst: mean reward of the image's other samples (Luo 2020) or of the greedy caption (Rennie 2017)",
    ] = "mean"
    bleu_weight: Annotated[float, "scst: reward = CIDEr-D + this x BLEU-4"] = 0.0
    context: Annotated[
        Literal["expected", "sample"],
        "--scst-context",
        "scst, hard attention: sample words with the expected context, or sample locations too",
    ] = EXPECTED
    # <end> counts as a word in the reward, as in ruotianluo/ImageCaptioning.pytorch: without it
    # a caption that stops mid-phrase ("a red circle left of a") loses nothing for it.
    end_token: Annotated[bool, "--no-end-token", "scst: leave <end> out of the reward's n-grams"] = True

    def __post_init__(self):
        if self.baseline not in BASELINES:
            raise OptionError(f"baseline must be one of {BASELINES}, got {self.baseline!r}")
        if self.baseline == "mean" and self.samples < 2:
            raise OptionError(
                "--samples: the mean baseline needs at least 2 samples per image (or pass --scst-baseline greedy)"
            )
        if self.context not in (EXPECTED, SAMPLE):
            raise OptionError(f"context must be {EXPECTED!r} or {SAMPLE!r}, got {self.context!r}")


def training_scorer(data: CaptionData, end_token: bool = True) -> NgramScorer:
    """CIDEr-D (and BLEU-4) against each training image's training references, with document
    frequencies of those references cached in the data directory."""
    words = torch.from_numpy(data.tokens[:, 1:].astype(np.int64))  # (C, T) words, <end>, <pad>...
    lengths = torch.from_numpy(data.lengths.astype(np.int64)) - 2 + int(end_token)
    refs = References(words, lengths, torch.from_numpy(data.rows.astype(np.int64)), base=len(data.vocab))
    df = cached_document_frequency(os.path.join(data.dir, "cider_df.npz"), refs, salt="\n".join(data.vocab.words))
    return NgramScorer(refs, df)


class Samples(NamedTuple):
    tokens: torch.Tensor  # (N, T) words, <end>, then <pad>
    words: torch.Tensor  # (N,) words before <end>
    logp: torch.Tensor  # (N,) log p(w|a) (+ log p(s|a) of sampled locations), differentiable
    entropy: torch.Tensor  # (N,) entropy of the word distributions, summed over the caption's steps


def sample_captions(
    decoder: AttentionDecoder,
    features: torch.Tensor,
    n: int,
    max_len: int,
    *,
    mode: str = EXPECTED,
    generator: torch.Generator | None = None,
) -> Samples:
    """Draw n captions per image from the decoder, step by step, keeping the graph for log p. The same
    words are banned as in decoding, and a caption reaching max_len words is ended there."""
    feats = decoder.normalize(features)  # (B, L, D)
    projected = decoder.attention.project(feats).repeat_interleave(n, dim=0)  # (N, L, A)
    h, c = (s.repeat_interleave(n, dim=0) for s in decoder.init_state(feats))  # (N, H)
    feats = feats.repeat_interleave(n, dim=0)  # (N, L, D)
    N, V = feats.size(0), decoder.config.vocab_size
    masks = [torch.zeros(V, device=feats.device) for _ in range(2)]  # the first step's, the others'
    for mask, first in zip(masks, (True, False)):
        mask[banned(first=first)] = float("-inf")
    words = torch.full((N,), START_ID, dtype=torch.long, device=feats.device)
    alive = torch.ones(N, dtype=torch.bool, device=feats.device)
    logp = feats.new_zeros(N, dtype=torch.float32)
    entropy = feats.new_zeros(N, dtype=torch.float32)
    tokens = []
    check = CHECK_EVERY if feats.is_cuda else 1
    for t in range(max_len + 1):
        logits, h, c, alpha, loc = decoder.step(feats, projected, words, h, c, mode, generator)
        if t == max_len:  # out of room: end now (no choice, no gradient)
            tokens.append(torch.where(alive, END_ID, PAD_ID))
            break
        step_logp = (logits.float() + masks[t > 0]).log_softmax(dim=-1)  # (N, V)
        p = step_logp.detach().exp()  # (N, V)
        drawn = sample_from(p, generator)  # (N,)
        chosen = step_logp.gather(1, drawn.unsqueeze(1)).squeeze(1)  # (N,)
        if loc is not None:  # the sampled location is a choice too
            chosen = chosen + alpha.float().gather(1, loc.unsqueeze(1)).squeeze(1).clamp_min(LOG_EPS).log()
        logp = logp + torch.where(alive, chosen, 0.0)
        entropy = entropy + torch.where(alive, -(p * step_logp.detach().clamp_min(-1e30)).sum(1), 0.0)
        words = torch.where(alive, drawn, PAD_ID)
        tokens.append(words)
        alive = alive & (words != END_ID)
        if (t + 1) % check == 0 and not bool(alive.any()):  # on a GPU the host looks every few words
            break
    tokens = torch.stack(tokens, 1)  # (N, T)
    return Samples(tokens, ((tokens != PAD_ID) & (tokens != END_ID)).sum(1), logp, entropy)


def greedy_tokens(
    decoder: AttentionDecoder, features: torch.Tensor, max_len: int, compiled: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The test-time greedy captions (beam size 1), without dropout: tokens (B, T) (words, <end>, <pad>...)
    and the words (B,) before <end>."""
    was_training = decoder.training
    decoder.eval()
    with no_autocast(features.device):  # as at test time, in the model's precision
        found = beam_search(decoder, features, beam_size=1, max_len=max_len, compiled=compiled)
    hyps = [beams[0].tokens for beams in found]
    decoder.train(was_training)
    tokens = torch.zeros(len(hyps), max(len(h) for h in hyps) + 1, dtype=torch.long)
    for i, h in enumerate(hyps):
        tokens[i, : len(h) + 1] = torch.tensor(h + [END_ID], dtype=torch.long)
    return tokens, torch.tensor([len(h) for h in hyps])


class SelfCritical(Term):
    """The SCST loss as a term: it samples its own captions from the batch's images (no teacher-forced
    pass) and scores them on the host, so the step does not compile it."""

    name = "scst"
    capturable = False
    teacher_forced = False

    def __init__(self, cfg: ScstConfig, scorer: NgramScorer, max_len: int, *, compiled: bool = False):
        super().__init__(1.0)
        self.cfg, self.scorer, self.max_len, self.compiled = cfg, scorer, max_len, compiled
        self._report: dict[str, torch.Tensor] = {}
        self.greedy: tuple | None = None  # (features, the greedy captions' tokens and words), from `before_pass`

    def reward(self, tokens: torch.Tensor, words: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """r(w) (N,) float64 on the CPU: CIDEr-D (+ bleu_weight · BLEU-4)."""
        cider, bleu = self.scorer.score(tokens, words + int(self.cfg.end_token), rows, bleu=self.cfg.bleu_weight > 0)
        return cider if bleu is None else cider + self.cfg.bleu_weight * bleu

    def before_pass(self, decoder, batch) -> None:
        """The greedy baseline's search, outside DDP's forward, where the compiler's DDPOptimizer would cut the
        compiled search into a graph per gradient bucket."""
        if self.cfg.baseline == "greedy":
            self.greedy = (batch.features, greedy_tokens(decoder, batch.features, self.max_len, self.compiled))

    def __call__(self, ctx: Context) -> torch.Tensor:
        """The loss per image of the mean over its samples; `ctx.words` counts the images (under DDP,
        the global count over processes)."""
        decoder, n = ctx.decoder, self.cfg.samples
        mode = SAMPLE if decoder.config.attention == "hard" and self.cfg.context == SAMPLE else EXPECTED
        s = sample_captions(decoder, ctx.features, n, self.max_len, mode=mode, generator=ctx.generator)
        rows = ctx.batch.rows.cpu()  # the rewards are computed on the host
        reward = self.reward(s.tokens, s.words, rows.repeat_interleave(n)).view(-1, n)  # (B, n)
        if self.cfg.baseline == "greedy":
            searched, self.greedy = self.greedy, None
            fresh = searched is None or searched[0] is not ctx.features
            tokens, words = greedy_tokens(decoder, ctx.features, self.max_len, self.compiled) if fresh else searched[1]
            base = self.reward(tokens, words, rows).unsqueeze(1).expand(-1, n)  # (B, n)
        else:
            base = (reward.sum(1, keepdim=True) - reward) / (n - 1)  # (B, n), the others' mean
        device = s.logp.device
        advantage = (reward - base).float().to(device).view(-1)  # (N,)
        steps = (s.words + 1).sum().clamp_min(1)
        self._report = {  # on the step's device, as every term's values
            "reward": reward.mean().float().to(device),
            "baseline": base.mean().float().to(device),
            "entropy": s.entropy.sum() / steps,
            "sample_words": s.words.float().mean(),
            "advantage_abs": advantage.abs().mean(),
        }
        return -(advantage * s.logp).sum() / (ctx.words * n)

    def report(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().float() for k, v in self._report.items()}
