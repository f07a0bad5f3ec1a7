"""Scoring a validation: the captions of a split of a prepared data directory (validation during `fit`, and
`evaluate`), scored through the official coco-caption code (pycocoevalcap), and the health of their attention maps.

With Java (the PTB tokenizer and METEOR run on it) the numbers are those of the official pipeline, and `"official"` is
true: BLEU-1..4, METEOR, ROUGE-L, CIDEr. Without Java they are BLEU (nltk's corpus BLEU), ROUGE-L and CIDEr on Python
tokenisation, METEOR is None, and `"official"` is false. SPICE is left out: it downloads models and needs Java 8. Scores
are computed on the caption text, i.e. on words already cut at <end>, never on padded ids.

Attention health tells meaningful maps from collapsed or parked ones, with no boxes. A soft-attention model can write
good captions while its maps say nothing: attention rests on one cell (often on the grid's border, where the encoder's
zero padding makes the features stand out), whatever the word. These figures catch that from the maps alone:

- entropy: the mean entropy of the maps, as a fraction of log L (0: one cell, 1: spread evenly);
- stay: per caption, the share of its words whose peak cell is the caption's most common one, averaged over captions;
- border: the share of peaks on the grid's outer ring, over that ring's share of the cells (about 1 for peaks spread
  evenly);
- top5: the share of all peaks on the five cells most often peaked at, over all images.

Shapes: n images (words of a caption, for the health), L = g·g locations on a grid of side g, D feature size.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import lru_cache

import numpy as np
import torch

from captioner.data.dataset import CaptionData
from captioner.data.encoder_inputs import complete_input_cache, encoded_features
from captioner.decoding.beams import Hypothesis
from captioner.decoding.decode import decode, generator_for
from captioner.decoding.settings import Decoding
from captioner.models.decoder import AttentionDecoder
from captioner.models.encoder import Encoder, apply_encoder_state
from captioner.models.tuned import TunedEncoder, layers_of
from captioner.models.vocab import Vocabulary, tokenize

ALL_METRICS = ("BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "METEOR", "ROUGE-L", "CIDEr")


@lru_cache(maxsize=1)
def java_available() -> bool:
    java = shutil.which("java")
    if not java:
        return False
    try:
        return subprocess.run([java, "-version"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _python_tokenize(captions: Mapping[int, Sequence[str]]) -> dict[int, list[str]]:
    return {i: [" ".join(tokenize(c)) for c in caps] for i, caps in captions.items()}


def _ptb_tokenize(captions: Mapping[int, Sequence[str]]) -> dict[int, list[str]]:
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    return PTBTokenizer().tokenize({i: [{"caption": c} for c in caps] for i, caps in captions.items()})


def score_captions(
    results: Mapping[int, str],
    references: Mapping[int, Sequence[str]],
    *,
    metrics: Sequence[str] = ALL_METRICS,
    use_java: bool | None = None,
) -> dict:
    """Score generated captions against raw reference texts, as coco-caption does: metric name → score
    (fractions; CIDEr as is), plus "official" and "tokenizer". `use_java`: None uses Java when present.
    Raises `ValueError` when a result's image has no references.
    """
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.rouge.rouge import Rouge

    ids = sorted(results)
    missing = [i for i in ids if not references.get(i)]
    if missing:
        raise ValueError(f"no reference captions for image ids {missing[:5]}")
    java = java_available() if use_java is None else (use_java and java_available())
    tok = _ptb_tokenize if java else _python_tokenize
    gts = tok({i: list(references[i]) for i in ids})
    res = tok({i: [results[i]] for i in ids})
    out: dict = {"official": java, "tokenizer": "ptb" if java else "python"}
    if any(m.startswith("BLEU") for m in metrics):
        if java:
            bleu, _ = Bleu(4).compute_score(gts, res, verbose=0)
        else:
            bleu = _nltk_bleu(gts, res, ids)
        out.update({f"BLEU-{n}": float(bleu[n - 1]) for n in range(1, 5)})
    if "METEOR" in metrics:
        if java:
            from pycocoevalcap.meteor.meteor import Meteor

            meteor = Meteor()
            try:
                out["METEOR"] = float(meteor.compute_score(gts, res)[0])
            finally:
                meteor.close() if hasattr(meteor, "close") else None
        else:
            out["METEOR"] = None
    if "ROUGE-L" in metrics:
        out["ROUGE-L"] = float(Rouge().compute_score(gts, res)[0])
    if "CIDEr" in metrics:
        out["CIDEr"] = float(Cider().compute_score(gts, res)[0])
    return out


def _nltk_bleu(gts, res, ids) -> list[float]:
    from nltk.translate.bleu_score import corpus_bleu

    refs = [[r.split() for r in gts[i]] for i in ids]
    hyps = [res[i][0].split() for i in ids]
    weights = [tuple([1.0 / n] * n) for n in range(1, 5)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nltk warns when an n-gram order has no match: BLEU is 0 then
        return [corpus_bleu(refs, hyps, weights=w) for w in weights]


def reference_agreement(
    references: Mapping[int, Sequence[str]],
    *,
    metrics: Sequence[str] = ("BLEU-4", "CIDEr"),
    use_java: bool | None = None,
) -> dict[str, float]:
    """How well the references agree with each other: the score a model could expect from writing like one
    more annotator (each image's k-th reference against its others, averaged over k). Raises `ValueError`
    when an image has fewer than two references.
    """
    counts = [len(r) for r in references.values()]
    if not counts or min(counts) < 2:
        raise ValueError("reference agreement needs at least two references per image")
    runs = []
    for k in range(min(counts)):
        held = {i: refs[k] for i, refs in references.items()}
        rest = {i: [*refs[:k], *refs[k + 1 :]] for i, refs in references.items()}
        runs.append(score_captions(held, rest, metrics=metrics, use_java=use_java))
    return {m: sum(r[m] for r in runs) / len(runs) for m in metrics}


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


# Where the figures say the maps are not meaningful, set from models scored against object boxes (docs/attention.md has
# the runs): pointing fell as the border ratio rose, as more peaks crowded onto a few cells, and with maps spread almost
# evenly. "stay" is reported but never warned on: models that point well stay on one object in one-object scenes. A
# sharp map is not a failure: the view consistency trains maps onto a cell or two of the object, and parking on one
# place is what top5 and border catch.
LIMITS = {"top5": 0.25, "border": 1.2, "entropy_high": 0.88}


def attention_health(captions: Iterable[np.ndarray]) -> dict:
    """Health figures of many captions' maps, one (n, g, g) or (n, L) array per caption; None without
    words."""
    entropies, stays, peaks = [], [], []
    L = None
    for attention in captions:
        a = np.asarray(attention, dtype=np.float64)
        a = a.reshape(a.shape[0], -1) if a.size else np.zeros((0, 1))  # (n, L)
        if len(a) == 0:
            continue
        L = a.shape[1]
        a = a / np.maximum(a.sum(1, keepdims=True), 1e-12)  # fp16 maps round their sums
        entropies.append(-(a * np.log(np.clip(a, 1e-12, None))).sum(1) / math.log(L))  # (n,)
        top = a.argmax(1)  # (n,) peak cell per word
        stays.append(Counter(top.tolist()).most_common(1)[0][1] / len(top))
        peaks.append(top)
    if not peaks:
        return {"entropy": None, "stay": None, "border": None, "top5": None, "words": 0, "captions": 0}
    g = int(round(math.sqrt(L)))
    cells = np.concatenate(peaks)  # (words,)
    row, col = cells // g, cells % g
    on_border = (row == 0) | (row == g - 1) | (col == 0) | (col == g - 1)
    border_share = (4 * g - 4) / (g * g) if g > 1 else 1.0
    counts = np.bincount(cells, minlength=L)
    return {
        "entropy": float(np.concatenate(entropies).mean()),
        "stay": float(np.mean(stays)),
        "border": float(on_border.mean() / border_share),
        "top5": float(np.sort(counts)[::-1][:5].sum() / len(cells)),
        "words": int(len(cells)),
        "captions": len(peaks),
    }


def problems(health: dict) -> list[str]:
    """What the figures say is wrong with the maps, one sentence each (empty when healthy)."""
    if not health.get("words"):
        return []
    out = []
    if health["top5"] >= LIMITS["top5"]:
        out.append(f"{health['top5']:.0%} of all peaks fall on the same five cells, whatever the image")
    if health["border"] >= LIMITS["border"]:
        out.append(f"peaks fall on the grid's border {health['border']:.1f}x as often as its area would give")
    if health["entropy"] >= LIMITS["entropy_high"]:
        out.append("the maps are spread almost evenly over the image")
    return out


def advice(*, boxes: bool) -> str:
    """What to try when the health check flags a run's maps; `boxes`: the run had `fit --boxes`."""
    return (
        "the heatmaps may not show what the model names. Check that `prepare` stored the images' views "
        "(its default: the attention consistency needs them) and that --consistency is on; "
        + ("" if boxes else "with object boxes, `fit --boxes` teaches attention where the objects are; ")
        + "maps spread evenly: lower --alpha-c; see docs/attention.md"
    )


def health_summary(health: dict) -> str:
    """One line for logs and model cards."""
    if not health.get("words"):
        return "attention health: no words to judge"
    figures = (
        f"entropy {health['entropy']:.2f}, stay {health['stay']:.2f}, border {health['border']:.2f}x, "
        f"top-5 cells {health['top5']:.2f}"
    )
    found = problems(health)
    return f"attention health: {figures}" + (f" - NOT MEANINGFUL: {'; '.join(found)}" if found else " - ok")


def verdict(health: dict | None) -> dict | None:
    """Whether maps are meaningful, as checkpoints record it: {"meaningful", "problems", "health"};
    None without figures (no validation yet)."""
    if not health or not health.get("words"):
        return None
    found = problems(health)
    return {"meaningful": not found, "problems": found, "health": health}
