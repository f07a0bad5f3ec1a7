"""Decoding on PyTorch. The beam search runs in one of two shapes, which give the same captions and maps:
- packed (CPUs): the NumPy beam search over the decoder's step, whose tensors share memory with its arrays;
- fixed (GPUs): every beam steps every time, a finished beam's step thrown away, and the host looks at
  the device only every `CHECK_EVERY` steps; where a caller asks (`compiled`), each block of steps is
  compiled, and on a GPU replayed as a CUDA graph.

Symbols: B images, K beams, N = B·K, L locations, D feature size, V vocabulary, T steps.
"""

from __future__ import annotations

import numpy as np
import torch

from captioner.decoding.beams import Hypothesis, best_first, hypotheses, search, trace
from captioner.decoding.posterior import posterior_maps
from captioner.decoding.sampling import sample_captions
from captioner.decoding.search_state import Search, fixed_length, fixed_search
from captioner.decoding.settings import Decoding
from captioner.models.decoder import EXPECTED, AttentionDecoder

__all__ = ["ROUTINES", "DecoderStep", "Hypothesis", "beam_search", "decode", "generator_for"]


@torch.inference_mode()
def beam_search(
    decoder: AttentionDecoder,
    features: torch.Tensor,
    *,
    beam_size: int = 3,
    max_len: int = 20,
    length_norm: bool = Decoding.length_norm,
    mode: str = EXPECTED,
    generator: torch.Generator | None = None,
    shapes: str | None = None,
    compiled: bool = False,
    sharpness: float | None = None,
) -> list[list[Hypothesis]]:
    """For each image, its K = `beam_size` hypotheses, best first (1 is greedy), from a decoder in eval mode;
    `max_len` and `length_norm` as `beams.search` takes them. `mode` is the context from α: "expected" (soft),
    "argmax" or "sample" (hard models, from `generator`). `shapes` ("packed" or "fixed", module doc) defaults to
    fixed on a GPU or when `compiled`, which earns back its compile only over thousands of searches.
    `sharpness` is k of the maps softmax(k e_t) (None: the model's `decode_sharpness`).
    """
    if beam_size < 1 or max_len < 1:
        raise ValueError(f"beam_size and max_len must be positive, got {beam_size} and {max_len}")
    if (shapes or ("fixed" if features.is_cuda or compiled else "packed")) == "packed":
        step = DecoderStep(decoder, features, beam_size, mode=mode, generator=generator, sharpness=sharpness)
        return search(step, max_len, length_norm)
    s = Search.start(decoder, features, beam_size, fixed_length(max_len), static=compiled)
    steps = fixed_search(decoder, s, max_len, mode, generator, sharpness, compiled=compiled)
    # The history goes to the host in one copy each, and is traced back there.
    history = (x[:steps].cpu().numpy() for x in (s.word, s.parent, s.alpha, s.loc))
    return best_first(hypotheses(*trace(*history), s.scores.cpu().numpy(), max_len), length_norm)


class DecoderStep:
    """The decoder's step over the K beams of each image of a batch on the CPU, for `decoding.beams.search`: the
    search's NumPy arrays go in and come out as tensors that share their memory (no copies)."""

    def __init__(self, decoder: AttentionDecoder, features: torch.Tensor, K: int, *, mode, generator, sharpness):
        if features.device.type != "cpu":
            raise ValueError(f"the packed search runs on the CPU, not on {features.device}: shapes='fixed'")
        self.decoder, self.beams = decoder, K
        self.images, self.locations, _ = features.shape
        self.vocabulary = decoder.config.vocab_size
        features, projected, *self.state = decoder.start(features)
        self.feats = features.repeat_interleave(K, dim=0)  # (N, L, D)
        self.projected = projected.repeat_interleave(K, dim=0)  # (N, L, A)
        self.settings = (mode, generator, decoder.joined(), sharpness)  # the step's weights joined once a search

    def start(self) -> tuple[np.ndarray, np.ndarray]:
        return tuple(x.repeat_interleave(self.beams, dim=0).numpy() for x in self.state)  # (N, H) each

    def __call__(self, rows, words, h, c):
        feats, projected = self.feats, self.projected
        if rows is not None:
            rows = torch.from_numpy(rows)
            feats, projected = feats[rows], projected[rows]
        words, h, c = (torch.from_numpy(x) for x in (words, h, c))
        logits, h, c, alpha, loc = self.decoder.step(feats, projected, words, h, c, *self.settings)
        loc = None if loc is None else loc.numpy()
        return logits.float().log_softmax(dim=-1).numpy(), h.numpy(), c.numpy(), alpha.float().numpy(), loc


def _beam(decoder, features, s: Decoding, max_len, generator, compiled):
    return beam_search(
        decoder,
        features,
        beam_size=s.beam_size,
        max_len=max_len,
        length_norm=s.length_norm,
        mode=s.context,
        generator=generator,
        compiled=compiled,
        sharpness=s.sharpness,
    )


def _sampling(decoder, features, s: Decoding, max_len, generator, compiled):
    return sample_captions(
        decoder,
        features,
        n=s.n,
        max_len=max_len,
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p,
        mode=s.context,
        generator=generator,
        sharpness=s.sharpness,
    )


# Each method's routine (`decoding.settings.METHODS` says what it reads):
# (decoder, features (B, L, D), settings, max_len, generator, compiled) → each image's hypotheses.
ROUTINES = {"beam": _beam, "sampling": _sampling}


def decode(
    decoder: AttentionDecoder,
    features: torch.Tensor,
    settings: Decoding,
    *,
    max_len: int,
    generator: torch.Generator | None = None,
    compiled: bool = False,
) -> list[list[Hypothesis]]:
    """For each image its hypotheses, as `settings` say: the beams best first or the samples in the order
    drawn, the maps of those a caller shows as `settings.maps` says. `max_len` applies where `settings.max_len`
    is None; pass `generator` to go on drawing across batches.
    """
    generator = generator or generator_for(settings, features.device)
    found = ROUTINES[settings.method](decoder, features, settings, settings.max_len or max_len, generator, compiled)
    if settings.maps == "posterior":
        # The maps a caller shows: every sample, or each image's best beam.
        shown = [(b, j) for b, hyps in enumerate(found) for j in range(len(hyps) if settings.how.draws else 1)]
        rows = torch.tensor([b for b, _ in shown], dtype=torch.long, device=features.device)
        drawn = posterior_maps(decoder, features[rows], [found[b][j] for b, j in shown], settings.sharpness)
        for (b, j), hyp in zip(shown, drawn):
            found[b][j] = hyp
    return found


def generator_for(settings: Decoding, device: torch.device) -> torch.Generator | None:
    """The random source of one call, for all its batches, where the captions depend on `settings.seed`."""
    return seeded(settings.seed, device) if settings.randomised else None


def seeded(seed: int, device: torch.device) -> torch.Generator | None:
    """A random source on `device`; None on the meta device, which has none (and draws nothing real)."""
    if device.type == "meta":
        return None
    return torch.Generator(device=device).manual_seed(int(seed))
