"""`captioner export CHECKPOINT DIR`: a trained model as the ecosystem shares models.

Publish the folder with `hf upload ORG/NAME DIR .`; load it with `Captioner.load("hf://ORG/NAME")`.
"""

from __future__ import annotations

import os

from captioner.evaluation.metrics import health_summary
from captioner.models.backbones import backbone
from captioner.models.checkpoint import load_checkpoint
from captioner.models.encoder import EncoderSpec
from captioner.models.exported import write_exported
from captioner.models.hub import resolve

SCORES = ("BLEU-1", "BLEU-4", "METEOR", "ROUGE-L", "CIDEr", "pointing")


def export(checkpoint: str, out_dir: str) -> str:
    """Write the exported folder and its model card for a training checkpoint (a path or pinned URL)."""
    ck = load_checkpoint(resolve(checkpoint))
    write_exported(ck, out_dir)
    with open(os.path.join(out_dir, "README.md"), "w", encoding="utf-8") as f:
        f.write(model_card(ck))
    return out_dir


def model_card(ck: dict) -> str:
    """The README.md of an exported model, from what its checkpoint records."""
    enc, dec, card = ck["encoder"], ck["decoder"], ck.get("card") or {}
    g = EncoderSpec.from_dict(enc).grid
    weights = {"none": f"random, seeded ({enc.get('seed', 0)})", "imagenet": "ImageNet"}.get(
        enc["weights"], f"`{os.path.basename(enc['weights'])}`"
    )
    lines = [
        "---",
        "library_name: captioner",
        "pipeline_tag: image-to-text",
        "tags: [image-captioning, show-attend-and-tell, visual-attention]",
        "---",
        "",
        "# Show, Attend and Tell captioning model",
        "",
        f"A {dec.get('attention', 'soft')}-attention LSTM decoder (embedding {dec['embed_dim']}, LSTM "
        f"{dec['hidden_dim']}, attention {dec['attention_dim']}, {len(ck['vocab'])} words) over "
        f"{backbone(enc['arch']).name} features ({weights} weights"
        + (", its last layers trained with the decoder" if ck.get("encoder_state") else "")
        + f"), {ck['step']} optimizer steps. It writes a caption and, for each word, the "
        f"{g}×{g} map of where it looked" + _sharpness(dec),
        "",
        "## Trained on",
        "",
        _trained_on(ck),
        "",
        *_scores(ck),
        "## How it was made",
        "",
        "```bash",
        _command(ck),
        "```",
        "",
        *([str(card["decoding"]).capitalize() + ".", ""] if card.get("decoding") else []),
        "## Limits",
        "",
        _limits(ck),
        "",
        "## Use it",
        "",
        "```python",
        "from captioner import Captioner",
        "",
        'cap = Captioner.load("hf://ORG/NAME")  # or the path of this folder',
        'out = cap.caption("photo.jpg", beam_size=3)',
        "out.text, out.words, out.attention  # (words, grid, grid)",
        "```",
        "",
    ]
    return "\n".join(lines)


def _trained_on(ck: dict) -> str:
    card = ck.get("card") or {}
    if card.get("trained_on"):
        return str(card["trained_on"])
    data = (ck.get("data") or {}).get("dir")
    return f"the data prepared in `{data}`." if data else "not recorded in the checkpoint."


def _scores(ck: dict) -> list[str]:
    card, metrics = ck.get("card") or {}, ck.get("metrics") or {}
    test = card.get("test_metrics") or {}
    scores, where = (
        (test, f"test split ({card.get('test_images', '?')} images)")
        if test
        else (metrics, f"validation split ({metrics.get('images', '?')} images), at the checkpoint's last validation")
    )
    shown = [f"| {k} | {scores[k]:.3f} |" for k in SCORES if isinstance(scores.get(k), (int, float))]
    lines = []
    if shown:
        lines += [
            "## Scores",
            "",
            f"On the {where}, {card.get('scored_with', 'beam search of width 3')} (coco-caption's metrics as "
            "fractions; pointing: the share of object words whose attention peak lies on the object):",
            "",
            "| metric | value |",
            "| --- | --- |",
            *shown,
            "",
        ]
    health = card.get("attention_health") or metrics.get("attention_health")
    if health:
        lines += [f"A{health_summary(health)[1:]}.", ""]
    verdict = ck.get("attention") or {}
    if verdict.get("meaningful") is False:
        lines += [
            "**Its heatmaps are not meaningful**: the attention health check flagged them "
            f"({'; '.join(verdict.get('problems', []))}).",
            "",
        ]
    return lines


def _sharpness(dec: dict) -> str:
    """How its maps are drawn when it decodes, where that differs from training."""
    k = dec.get("decode_sharpness", 1.0)
    if k == 1.0:
        return "."
    return (
        f": it decodes with maps sharper than those it trained with, softmax({k:g} e) instead of softmax(e), so "
        "that each word's map commits to one place, and each map shown is the one its word was read from."
    )


def _command(ck: dict) -> str:
    card = ck.get("card") or {}
    python = '# trained by calling fit() from Python: its settings are "train" and "decoder" in config.json'
    command = str(card.get("rebuild") or ck.get("command") or python)
    return f"# at commit {card['commit']}\n{command}" if card.get("commit") else command


def _limits(ck: dict) -> str:
    card = ck.get("card") or {}
    if card.get("limits"):
        return str(card["limits"])
    if ck["encoder"]["weights"] == "none":
        return (
            "Its encoder has random, seeded weights: it describes the kind of pictures it was trained on and "
            "nothing else; a photograph gets a caption in those words (the model says when an image is unlike "
            "its training images)."
        )
    return "It knows the words and scenes of its training data; other pictures get captions in those words."
