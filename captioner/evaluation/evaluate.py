"""`evaluate`: caption a split with a checkpoint, score it, and write the metrics and captions."""

from __future__ import annotations

import logging
import os

import numpy as np
import torch

from captioner.compiled import earns_back
from captioner.data.boxes import GroundingBoxes
from captioner.data.dataset import CaptionData
from captioner.decoding.settings import Decoding
from captioner.errors import CaptionerError
from captioner.evaluation.grounding import pointing_accuracy
from captioner.evaluation.metrics import (
    ALL_METRICS,
    SEARCH_BATCH,
    attention_health,
    caption_split,
    checkpoint_features,
    score_captions,
)
from captioner.io import write_json_atomic
from captioner.models.encoder import build_encoder
from captioner.models.hub import load_trained

log = logging.getLogger(__name__)


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
    decoding: Decoding | None = None,
    device: str = "cpu",
    use_java: bool | None = None,
    grounding: str | None = None,
    cuda_graphs: str = "auto",
) -> dict:
    """Caption a split with a checkpoint and write the metrics JSON and the COCO results JSON; return the
    metrics.

    `checkpoint` is a checkpoint, an exported folder, a pinned URL or hf://ORG/NAME; `grounding` a COCO
    instances file of object boxes, which adds pointing accuracy. `use_java`: None uses Java when present.
    Raises `CaptionerError` when `decoding.n` is not 1, the data's encoder is not the checkpoint's, or `split`
    is unknown.
    """
    decoding = decoding or Decoding()
    if decoding.n != 1:
        raise CaptionerError(f"evaluate scores one caption per image: --n must be 1, got {decoding.n}")
    model = load_trained(checkpoint)
    data = _data_for(model, data_dir, checkpoint, split)
    compiled = cuda_graphs == "auto" and earns_back(-(-len(data.split_images(split)[0]) // SEARCH_BATCH))
    search = dict(decoding=decoding, max_len=model.max_len, compiled=compiled and torch.device(device).type == "cuda")
    texts, hyps = _captions(model, data, checkpoint, split, torch.device(device), search)
    metrics = score_captions(texts, data.references[split], metrics=ALL_METRICS, use_java=use_java)
    if not metrics["official"]:
        log.warning(
            "Java was not found (or does not run), so these are not coco-caption's figures: BLEU is nltk's "
            'on Python tokenisation and METEOR is missing (metrics JSON: "official": false); install a Java '
            "runtime (8 or later) for the official metrics"
        )
    if grounding:
        metrics.update(_grounding(model, texts, hyps, grounding))
    metrics["attention_health"] = attention_health(h.attention for h in hyps.values())
    metrics.update(
        _coverage(data, split, texts),
        split=split,
        beam_size=decoding.beam_size,
        decoding=decoding.to_dict(),
        step=model.step,
        mean_length=float(np.mean([len(h.tokens) for h in hyps.values()])) if hyps else 0.0,
        cut_captions=sum(not h.ended for h in hyps.values()),
        checkpoint=checkpoint if "://" in checkpoint else os.path.abspath(checkpoint),
    )
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    write_json_atomic(results_path(out), [{"image_id": i, "caption": texts[i]} for i in sorted(texts)])
    write_json_atomic(out, metrics)
    return metrics


def _grounding(model, texts: dict, hyps: dict, boxes: str) -> dict:
    """Pointing accuracy of the captions' maps against the object boxes in `boxes`."""
    g = model.encoder.grid
    words = {i: (texts[i].split(), h.attention.reshape(-1, g, g)) for i, h in hyps.items()}
    found = pointing_accuracy(words, GroundingBoxes(boxes), model.encoder.preprocess)
    return {"grounding": found, "pointing": found["pointing"], "two_objects": found["two_objects"]}


def _data_for(model, data_dir: str, checkpoint: str, split: str) -> CaptionData:
    """The prepared data, refused unless its features come from the checkpoint's encoder."""
    data, spec = CaptionData(data_dir), model.encoder
    if data.encoder.fingerprint != spec.fingerprint:
        raise CaptionerError(
            f"{checkpoint} was trained on features of encoder {spec.fingerprint} ({spec.weights}), but {data_dir} "
            f"holds features of encoder {data.encoder.fingerprint} ({data.encoder.weights}); prepare the data with "
            "the same encoder"
        )
    if split not in data.references:
        raise CaptionerError(f"--split must be one of {sorted(data.references)}, got {split!r}")
    return data


def _captions(model, data: CaptionData, checkpoint: str, split: str, device, search: dict):
    """The split's captions and hypotheses, from the cache or, fine-tuned, from the checkpoint's encoder."""
    features = None
    if model.encoder_state is not None:  # the cache holds the frozen encoder's features, not this one's
        features = checkpoint_features(build_encoder(data.encoder)[0], model.encoder_state, data, device, checkpoint)
    return caption_split(model.decoder.to(device), data, model.vocab, split, features=features, **search)


def _coverage(data: CaptionData, split: str, texts: dict) -> dict:
    """How many of the split's images were scored, said on the console when some were not."""
    missing = list(data.dropped.get(split, []))
    size = len(texts) + len(missing)
    if missing:
        log.warning(
            f"{len(missing)} of the {size} {split} images were not scored: their features could not be "
            f"extracted when {data.dir} was prepared (unreadable images, --skip-bad); the figures cover "
            f"the other {len(texts)} (metrics JSON: missing_image_ids)"
        )
    return {"images": len(texts), "split_images": size, "missing_images": len(missing), "missing_image_ids": missing}
