"""What the page says about its model, all from the checkpoint: the notice on top, the model panel,
the examples' record (the bundled model's card is written by `python -m tools.build_demo`)."""

from __future__ import annotations

import os
from collections.abc import Sequence

from captioner.demo.options import PAGE_BEAM
from captioner.evaluation.metrics import health_summary
from captioner.models.backbones import backbone
from captioner.serve.api import Captioner

METRICS = ("BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "METEOR", "ROUGE-L", "CIDEr", "pointing", "two_objects")
CARD_DATA_KEYS = ("trained_on", "data", "dataset", "description")  # card fields that say what it learnt from
# Card fields shown by their own sections, not as plain "key: value" lines.
CARD_SECTIONS = (
    *CARD_DATA_KEYS,
    "test_images",
    "test_metrics",
    "attention_health",
    "examples",
    "scene_accuracy",
    "scene_accuracy_by_objects",
)
COUNTS = {"1": "one object", "2": "two", "3": "three"}
MAP_DECIMALS = 4  # the precision of the maps a card records for its examples


def trained_on(captioner: Captioner) -> str:
    """What the model was trained on, from its card, else from its encoder and data record."""
    card = captioner.info.get("card") or {}
    for text in (card.get(k) for k in CARD_DATA_KEYS):
        if isinstance(text, str) and text.strip():
            return text.strip()
    if captioner.encoder_spec.weights == "none":
        name = backbone(captioner.encoder_spec.arch).name
        return f"synthetic scenes of coloured shapes (`captioner.synthetic`), with a random, seeded {name} encoder"
    data = captioner.info.get("data") or {}
    return f"the data prepared in `{data['dir']}`" if data.get("dir") else "unknown (the checkpoint does not say)"


def model_notice(captioner: Captioner) -> str:
    """The paragraph above the page: what this model can and cannot describe, and if its heatmaps are trusted."""
    # Its encoder, random or pretrained on the scenes, separates only what they vary: colours, shapes, places.
    if captioner.encoder_spec.weights == "none" or "synthetic scenes" in trained_on(captioner):
        notice = (
            "**This demo model knows only pictures of coloured shapes, like the examples below.** "
            "It describes every picture as if it were one of them, so a photograph gets a caption "
            "about shapes; the page says when a picture is unlike the ones it was trained on. "
            "To caption photographs, serve a model trained on photos such as MS-COCO (docs/training.md)."
        )
    else:
        notice = f"**This model was trained on {trained_on(captioner)}.**"
    warning = captioner.attention_warning
    return notice + (f"\n\n⚠ **{warning}**" if warning else "")


def attention_health(captioner: Captioner) -> dict | None:
    """The model's attention-health figures: the demo card's (test scenes), else validation's."""
    card = captioner.info.get("card") or {}
    for source in (card, captioner.info.get("metrics") or {}):
        if isinstance(source.get("attention_health"), dict):
            return source["attention_health"]
    return None


def _metrics_table(test: dict, val: dict, test_n, val_n) -> list[str]:
    """One row per metric (columns test, validation): narrow enough for the side panel."""
    names = [m for m in METRICS if m in test or m in val]
    cols = [
        (f"Test ({test_n} images)" if test_n else "Test", test),
        (f"Validation ({val_n} images)" if val_n else "Validation", val),
    ]
    cols = [(title, values) for title, values in cols if values]
    lines = ["| Metric | " + " | ".join(t for t, _ in cols) + " |", "|---" + "|---:" * len(cols) + "|"]
    for m in names:
        cells = [f"{values[m]:.3f}" if isinstance(values.get(m), (int, float)) else "" for _, values in cols]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return lines


def model_card(captioner: Captioner) -> str:
    """Markdown for the model panel: training data, metrics, attention health, sizes."""
    info, spec, cfg = captioner.info, captioner.encoder_spec, captioner.decoder.config
    weights = {"none": f"random, seeded ({spec.seed})", "imagenet": "ImageNet"}.get(spec.weights, f"`{spec.weights}`")
    train = info.get("train") or {}
    fine_tune = train.get("fine_tune") if captioner.encoder_state is not None else None
    tuned = f"; {fine_tune.get('start', 'its last layers')} onward trained on the captions" if fine_tune else ""
    lines = [
        f"- **Trained on:** {trained_on(captioner)}",
        f"- **Checkpoint:** `{os.path.basename(info.get('checkpoint', '?'))}`, {info.get('step', 0)} optimizer steps",
        f"- **Attention:** {captioner.attention_type}",
        f"- **Vocabulary:** {len(captioner.vocab)} words (special tokens included)",
        f"- **Encoder:** {backbone(spec.arch).name} ({weights} weights{tuned}), {spec.image_size}×{spec.image_size} "
        f"input → {spec.grid}×{spec.grid} attention grid",
        f"- **Decoder:** embedding {cfg.embed_dim}, LSTM {cfg.hidden_dim}, attention {cfg.attention_dim}",
    ]
    if train:
        optim, schedule, process = (train.get(k) or {} for k in ("optim", "schedule", "process"))
        lines.append(
            f"- **Training:** up to {process.get('epochs', '?')} epochs, batch {optim.get('batch_size', '?')}, "
            f"lr {optim.get('lr', '?')}, best checkpoint by {schedule.get('metric', '?')}"
        )
    card = info.get("card") or {}
    shown = {k: v for k, v in card.items() if k not in CARD_SECTIONS and isinstance(v, (str, int, float))}
    lines += [
        f"- **{k.replace('_', ' ').capitalize()}:** " + (f"`{v}`" if k == "rebuild" else f"{v}")
        for k, v in shown.items()
    ]
    if isinstance(card.get("scene_accuracy"), (int, float)):
        by = card.get("scene_accuracy_by_objects") or {}
        counts = ", ".join(f"{COUNTS.get(k, k)} {v:.0%}" for k, v in by.items() if isinstance(v, (int, float)))
        lines.append(
            f"- **Scenes described exactly right:** {card['scene_accuracy']:.0%} of "
            f"{card.get('test_images', 'the')} test scenes (every object's colour and shape, none missing"
            + (f"; {counts}" if counts else "")
            + ")"
        )
    health = attention_health(captioner)
    if health:
        lines.append(f"- **Attention health:** {health_summary(health).removeprefix('attention health: ')}")
    test = {k: v for k, v in (card.get("test_metrics") or {}).items() if isinstance(v, (int, float))}
    metrics = info.get("metrics") or {}
    val = {k: v for k, v in metrics.items() if k in METRICS and isinstance(v, (int, float))}
    both = "two_objects" in test or "two_objects" in val
    if test or val:
        lines += [
            "",
            "**Scores** (coco-caption; BLEU, METEOR, ROUGE-L as fractions; pointing: share of "
            "object words whose attention peak lies on the object"
            + ("; two_objects: share of captions naming two separate objects whose maps peak on both" if both else "")
            + "):",
            "",
            *_metrics_table(test, val, card.get("test_images"), metrics.get("images")),
        ]
    return "\n".join(lines)


def examples_note(captioner: Captioner, examples: Sequence[str]) -> str:
    """The line beside the examples: how they were chosen and how often the model gets them right."""
    card = captioner.info.get("card") or {}
    record = {e.get("file"): e for e in card.get("examples") or [] if isinstance(e, dict)}
    judged = [record[os.path.basename(p)] for p in examples if os.path.basename(p) in record]
    if not judged:
        return "Scenes like the ones this model was trained on."
    right = sum(bool(e.get("correct")) for e in judged)
    marks = " ".join("✓" if e.get("correct") else "✗" for e in judged)
    text = (
        "New scenes, the first of a seed fixed before the model was scored. It names every object right "
        f"(colour and shape, none missing or extra) in **{right} of these {len(judged)}** ({marks}, in order)"
    )
    if isinstance(card.get("scene_accuracy"), (int, float)):
        text += f" and in **{card['scene_accuracy']:.0%}** of all {card.get('test_images', 'its')} test scenes"
    return text + "."


def example_outputs(captioner: Captioner, paths: Sequence[str]) -> list[dict]:
    """What a model writes for each image as the page captions it: the caption, its score and each word's map."""
    outs = captioner.caption_batch(list(paths), beam_size=PAGE_BEAM)
    return [
        {
            "file": os.path.basename(path),
            "caption": out.text,
            "score": round(out.score, 6),
            "maps": [[round(float(x), MAP_DECIMALS) for x in word.ravel()] for word in out.attention],
        }
        for path, out in zip(paths, outs)
    ]
