"""Captioning a split of a prepared data directory: validation during `fit`, and `evaluate`.

Shapes: n images, L locations, D feature size.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from captioner.data.dataset import CaptionData
from captioner.data.encoder_inputs import complete_input_cache, encoded_features
from captioner.decoding.beams import Hypothesis
from captioner.decoding.decode import decode, generator_for
from captioner.decoding.settings import Decoding
from captioner.evaluation.metrics import score_captions
from captioner.models.decoder import AttentionDecoder
from captioner.models.encoder import Encoder, apply_encoder_state
from captioner.models.tuned import TunedEncoder, layers_of
from captioner.models.vocab import Vocabulary

SEARCH_BATCH = 50  # images per search


def caption_split(
    decoder: AttentionDecoder,
    data: CaptionData,
    vocab: Vocabulary,
    split: str,
    *,
    decoding: Decoding | None = None,
    max_len: int = 20,
    max_images: int | None = None,
    shard: tuple[int, int] = (0, 1),
    features: Callable[[np.ndarray], torch.Tensor] | None = None,
    compiled: bool = False,
) -> tuple[dict[int, str], dict[int, Hypothesis]]:
    """Captions for a split's images, one each (a beam search's best, or the first sample): image id →
    text, and image id → its hypothesis (with its attention), searched on the decoder's device.

    `shard` (rank, world) captions every world-th image from rank on; `features` maps rows to (n, L, D)
    features (default: the data's cache, which lacks a fine-tuned encoder's).
    """
    device, decoding = next(decoder.parameters()).device, decoding or Decoding()
    generator = generator_for(decoding, device)
    ids, rows = data.split_images(split)
    if max_images:
        ids, rows = ids[:max_images], rows[:max_images]
    rank, world = shard
    ids, rows = ids[rank::world], rows[rank::world]
    was_training = decoder.training
    decoder.eval()
    texts, hyps = {}, {}
    for i in range(0, len(ids), SEARCH_BATCH):
        feats = (features or data.features)(rows[i : i + SEARCH_BATCH]).to(device)  # (b, L, D)
        found = decode(decoder, feats, decoding, max_len=max_len, generator=generator, compiled=compiled)
        for image_id, written in zip(ids[i : i + SEARCH_BATCH], found):
            best = written[0]
            hyps[int(image_id)] = best
            texts[int(image_id)] = " ".join(vocab.decode(best.tokens))
    decoder.train(was_training)
    return texts, hyps


def score_validation(texts: dict[int, str], references: dict[int, list[str]]) -> dict:
    """Validation scores: BLEU-4 and CIDEr on Python tokenisation (fast, no Java)."""
    scores = score_captions(texts, references, metrics=("BLEU-4", "CIDEr"), use_java=False)
    return {
        "BLEU-4": scores["BLEU-4"],
        "CIDEr": scores["CIDEr"],
        "images": len(texts),
        "example": texts[min(texts)] if texts else "",
    }


def checkpoint_features(
    spec_encoder: Encoder, encoder_state: dict, data: CaptionData, device, source: str, workers: int = 2
) -> Callable[[np.ndarray], torch.Tensor]:
    """rows → features of a fine-tuned checkpoint's encoder (`spec_encoder` with the checkpoint's trained
    layers), which the feature cache no longer holds: on the pool4 cache when the data directory has a
    complete one for them, else on the images."""
    start = layers_of(encoder_state)
    cache = complete_input_cache(data, start)
    if cache is not None:
        encoder = TunedEncoder(spec_encoder.features, start, from_cache=True, arch=data.encoder.arch)
        encoder.load_encoder_state(encoder_state, source)
    else:
        encoder = apply_encoder_state(spec_encoder, encoder_state, source)
    encoder = encoder.to(device).eval()
    return lambda rows: encoded_features(encoder, data, rows, cache=cache, device=device, workers=workers)
