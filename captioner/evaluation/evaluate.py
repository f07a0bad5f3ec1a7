"""`evaluate`: caption a split with a checkpoint, score it, and write the metrics and captions."""

from __future__ import annotations

import os

import numpy as np
import torch

from captioner.data.boxes import GroundingBoxes
from captioner.data.dataset import CaptionData
from captioner.errors import CaptionerError
from captioner.evaluation.captioning import caption_split, checkpoint_features
from captioner.evaluation.grounding import pointing_accuracy
from captioner.evaluation.health import attention_health
from captioner.evaluation.metrics import ALL_METRICS, score_captions
from captioner.io import write_json_atomic
from captioner.models.checkpoint import load_checkpoint, read_trained
from captioner.models.decoder import EXPECTED
from captioner.models.encoder import build_encoder


def results_path(metrics_path: str) -> str:
    """Where the COCO results file goes, beside the metrics JSON."""
    root, _ = os.path.splitext(metrics_path)
    return f"{root}_results.json"


def evaluate(
    checkpoint: str,
    data_dir: str,
    split: str,
    out: str,
    *,
    beam_size: int = 3,
    max_len: int | None = None,
    device: str = "cpu",
    mode: str | None = None,
    use_java: bool | None = None,
    grounding: str | None = None,
) -> dict:
    """Caption a split with a checkpoint and write the metrics JSON and the COCO results JSON.

    Args:
        grounding: a COCO instances file of object boxes: adds pointing accuracy and its chance rate.

    Returns:
        The metrics written (all seven coco-caption metrics; METEOR is None without Java).
    """
    model = read_trained(load_checkpoint(checkpoint), checkpoint)
    spec, device = model.encoder, torch.device(device)
    data = CaptionData(data_dir)
    if data.encoder.fingerprint != spec.fingerprint:
        raise CaptionerError(
            f"{checkpoint} was trained on features of encoder {spec.fingerprint} "
            f"({spec.weights}), but {data_dir} holds features of encoder "
            f"{data.encoder.fingerprint} ({data.encoder.weights}); prepare the data with the same encoder"
        )
    if split not in data.references:
        raise CaptionerError(f"--split must be one of {sorted(data.references)}, got {split!r}")
    features = None
    if model.encoder_state is not None:
        # Fine-tuned: the cache holds the frozen encoder's features, not this encoder's.
        features = checkpoint_features(build_encoder(data.encoder)[0], model.encoder_state, data, device, checkpoint)
    texts, hyps = caption_split(
        model.decoder.to(device),
        data,
        model.vocab,
        split,
        beam_size=beam_size,
        max_len=max_len or model.max_len,
        device=device,
        mode=mode or EXPECTED,
        features=features,
    )
    metrics = score_captions(texts, data.references[split], metrics=ALL_METRICS, use_java=use_java)
    if grounding:
        g = spec.grid
        words = {i: (texts[i].split(), h.attention.reshape(-1, g, g)) for i, h in hyps.items()}
        metrics["grounding"] = pointing_accuracy(words, GroundingBoxes(grounding), spec.preprocess)
        metrics["pointing"] = metrics["grounding"]["pointing"]
    metrics["attention_health"] = attention_health(h.attention for h in hyps.values())
    lengths = [len(h.tokens) for h in hyps.values()]
    metrics.update(
        {
            "split": split,
            "images": len(texts),
            "beam_size": beam_size,
            "mean_length": float(np.mean(lengths)) if lengths else 0.0,
            "checkpoint": os.path.abspath(checkpoint),
            "step": model.step,
        }
    )
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    results = [{"image_id": i, "caption": texts[i]} for i in sorted(texts)]
    write_json_atomic(results_path(out), results)
    write_json_atomic(out, metrics)
    return metrics
