"""The one decoding routine: batched beam search (greedy is beam size 1 of it), on PyTorch.

Used by validation, evaluation, the Python API, the web demo and the notebooks. One search, two shapes
(the same captions and maps: tests):
- packed (CPUs): `decoding.beams.search`, written once for PyTorch's tensors and onnxruntime's arrays,
  over the decoder's step here (`DecoderStep`): only the beams still writing take a step, and the
  search stops as soon as none writes;
- fixed (GPUs): every beam steps every time, a finished beam's step thrown away, and the host
  looks at the device only every `CHECK_EVERY` steps to see whether all beams have ended
  (`decoding.search_state`). Where a caller asks (`compiled`), each block of steps is compiled, and on
  a GPU replayed as a CUDA graph.

Symbols: B images, K beams, N = B·K, L locations, V vocabulary, T steps.
"""

from __future__ import annotations

import torch

from captioner.decoding.beams import Hypothesis, best_first, host, hypotheses, search, trace
from captioner.decoding.search_state import Search, fixed_length, fixed_search
from captioner.models.attention import EXPECTED
from captioner.models.decoder import AttentionDecoder

__all__ = ["DecoderStep", "Hypothesis", "beam_search"]


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
        step = DecoderStep(decoder, features, beam_size, mode=mode, generator=generator, sharpness=sharpness)
        return search(step, max_len, ban_unk, length_norm)
    s = Search.start(decoder, features, beam_size, fixed_length(max_len), ban_unk, static=compiled)
    steps = fixed_search(decoder, s, max_len, mode, generator, sharpness, compiled=compiled)
    # The history goes to the host in one copy each, and is traced back there.
    history = (host(x[:steps]) for x in (s.word, s.parent, s.alpha, s.loc))
    return best_first(hypotheses(*trace(*history), s.scores, max_len), length_norm)


class TorchArrays:
    """`decoding.beams.Arrays` of PyTorch, on one device."""

    DTYPES = {"float": torch.float32, "long": torch.long, "bool": torch.bool}

    def __init__(self, device: torch.device):
        self.device = device

    def full(self, shape, value, dtype):
        return torch.full(shape, value, dtype=self.DTYPES[dtype], device=self.device)

    def arange(self, n):
        return torch.arange(n, device=self.device)

    def topk(self, x, k):
        return x.topk(k, dim=1)

    def flatnonzero(self, mask):
        return mask.nonzero().squeeze(1)

    def isfinite(self, x):
        return x.isfinite()


class DecoderStep:
    """The decoder's step over the K beams of each image of a batch (`decoding.beams.Step`): the features
    standardised and projected once, and the step's weights joined once (`AttentionDecoder.joined`).

    Args:
        features: (B, L, D) annotation vectors.
        mode, generator, sharpness: as `beam_search` takes them.
    """

    def __init__(self, decoder: AttentionDecoder, features: torch.Tensor, K: int, *, mode, generator, sharpness):
        self.decoder, self.mode, self.generator, self.sharpness = decoder, mode, generator, sharpness
        self.arrays = TorchArrays(features.device)
        (self.images, self.locations, _), self.beams = features.shape, K
        self.vocabulary = decoder.config.vocab_size
        features = decoder.normalize(features)  # (B, L, D)
        self.state = decoder.init_state(features)  # h_0, c_0 (B, H)
        self.feats = features.repeat_interleave(K, dim=0)  # (N, L, D)
        self.projected = decoder.attention.project(features).repeat_interleave(K, dim=0)  # (N, L, A)
        self.joined = decoder.joined()

    def start(self):
        return tuple(x.repeat_interleave(self.beams, dim=0) for x in self.state)  # (N, H) each

    def __call__(self, rows, words, h, c):
        feats, projected = (self.feats, self.projected) if rows is None else (self.feats[rows], self.projected[rows])
        logits, h, c, alpha, loc = self.decoder.step(
            feats, projected, words, h, c, self.mode, self.generator, self.joined, self.sharpness
        )
        return logits.float().log_softmax(dim=-1), h, c, alpha.float(), loc
