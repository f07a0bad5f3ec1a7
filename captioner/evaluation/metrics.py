"""Caption metrics through the official coco-caption code (pycocoevalcap).

With Java (the PTB tokenizer and METEOR run on it) the numbers are those of the official
pipeline, and `"official"` is true: BLEU-1..4, METEOR, ROUGE-L, CIDEr. Without Java they are
BLEU (nltk's corpus BLEU), ROUGE-L and CIDEr on Python tokenisation, METEOR is None, and
`"official"` is false. SPICE is left out: it downloads models and needs Java 8. Scores are
computed on the caption text, i.e. on words already cut at <end>, never on padded ids.
"""

from __future__ import annotations

import shutil
import subprocess
import warnings
from collections.abc import Mapping, Sequence
from functools import lru_cache

from captioner.models.vocab import tokenize

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

    Raises:
        ValueError: a result's image has no references.
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
    more annotator (each image's k-th reference against its others, averaged over k).

    Raises:
        ValueError: an image has fewer than two references.
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
