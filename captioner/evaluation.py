"""Captioning a split of a prepared data directory and scoring it: validation and `evaluate`."""
from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import torch

from .data import CaptionData, write_json_atomic
from .decode import Hypothesis, beam_search
from .decoder import EXPECTED, AttentionDecoder
from .encoder import build_encoder
from .errors import CaptionerError
from .health import attention_health
from .metrics import ALL_METRICS, score_captions
from .vocab import Vocabulary


def caption_split(decoder: AttentionDecoder, data: CaptionData, vocab: Vocabulary, split: str, *,
                  beam_size: int = 3, max_len: int = 20, batch_size: int = 50,
                  device: torch.device | str = "cpu", max_images: int | None = None,
                  mode: str = EXPECTED, shard: tuple[int, int] = (0, 1),
                  features: Callable[[np.ndarray], torch.Tensor] | None = None,
                  ) -> tuple[dict[int, str], dict[int, Hypothesis]]:
    """Beam-search captions for a split's images.

    Args:
        shard: (rank, world): caption only every world-th image from rank on.
        features: rows → (n, L, D) features; default the data's cache (a fine-tuned encoder's
            features are not in it: see finetune.py).

    Returns:
        image id → caption text, and image id → the best hypothesis (with its attention).
    """
    ids, rows = data.split_images(split)
    if max_images:
        ids, rows = ids[:max_images], rows[:max_images]
    rank, world = shard
    ids, rows = ids[rank::world], rows[rank::world]
    was_training = decoder.training
    decoder.eval()
    texts, hyps = {}, {}
    for i in range(0, len(ids), batch_size):
        feats = (features or data.features)(rows[i:i + batch_size]).to(device)  # (b, L, D)
        for image_id, beams in zip(ids[i:i + batch_size], beam_search(
                decoder, feats, beam_size=beam_size, max_len=max_len, mode=mode)):
            best = beams[0]
            hyps[int(image_id)] = best
            texts[int(image_id)] = " ".join(vocab.decode(best.tokens))
    decoder.train(was_training)
    return texts, hyps


def score_validation(texts: dict[int, str], references: dict[int, list[str]]) -> dict:
    """Validation scores: BLEU-4 and CIDEr on Python tokenisation (fast, no Java)."""
    scores = score_captions(texts, references, metrics=("BLEU-4", "CIDEr"), use_java=False)
    return {"BLEU-4": scores["BLEU-4"], "CIDEr": scores["CIDEr"], "images": len(texts),
            "example": texts[min(texts)] if texts else ""}


def results_path(metrics_path: str) -> str:
    """Where the COCO results file goes, beside the metrics JSON."""
    root, _ = os.path.splitext(metrics_path)
    return f"{root}_results.json"


def evaluate(checkpoint: str, data_dir: str, split: str, out: str, *, beam_size: int = 3,
             max_len: int | None = None, device: str = "cpu", mode: str | None = None,
             use_java: bool | None = None, grounding: str | None = None) -> dict:
    """Caption a split with a checkpoint and write the metrics JSON and the COCO results JSON.

    Args:
        grounding: a COCO instances file of object boxes: adds pointing accuracy and its chance rate.

    Returns:
        The metrics written (all seven coco-caption metrics; METEOR is None without Java).
    """
    from .api import Captioner
    cap = Captioner.load(checkpoint, device=device, build_encoder=False)
    data = CaptionData(data_dir)
    if data.encoder.fingerprint != cap.encoder_spec.fingerprint:
        raise CaptionerError(
            f"{checkpoint} was trained on features of encoder {cap.encoder_spec.fingerprint} "
            f"({cap.encoder_spec.weights}), but {data_dir} holds features of encoder "
            f"{data.encoder.fingerprint} ({data.encoder.weights}); prepare the data with the same encoder")
    if split not in data.references:
        raise CaptionerError(f"--split must be one of {sorted(data.references)}, got {split!r}")
    features = None
    if cap.encoder_state is not None:
        # Fine-tuned: the cache holds the frozen encoder's features, not this encoder's.
        from .finetune import checkpoint_features
        features = checkpoint_features(build_encoder(data.encoder)[0], cap.encoder_state, data, cap.device,
                                       checkpoint)
    texts, hyps = caption_split(cap.decoder, data, cap.vocab, split, beam_size=beam_size,
                                max_len=max_len or cap.max_len, device=cap.device,
                                mode=mode or cap.default_mode, features=features)
    metrics = score_captions(texts, data.references[split], metrics=ALL_METRICS, use_java=use_java)
    if grounding:
        from .grounding import GroundingBoxes, pointing_accuracy
        g = cap.encoder_spec.grid
        words = {i: (texts[i].split(), h.attention.reshape(-1, g, g)) for i, h in hyps.items()}
        metrics["grounding"] = pointing_accuracy(words, GroundingBoxes(grounding), cap.encoder_spec.preprocess)
        metrics["pointing"] = metrics["grounding"]["pointing"]
    metrics["attention_health"] = attention_health(h.attention for h in hyps.values())
    lengths = [len(h.tokens) for h in hyps.values()]
    metrics.update({"split": split, "images": len(texts), "beam_size": beam_size,
                    "mean_length": float(np.mean(lengths)) if lengths else 0.0,
                    "checkpoint": os.path.abspath(checkpoint), "step": cap.step})
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    results = [{"image_id": i, "caption": texts[i]} for i in sorted(texts)]
    write_json_atomic(results_path(out), results)
    write_json_atomic(out, metrics)
    return metrics
