"""Metrics agree with the official coco-caption pipeline (COCOEvalCap on pycocotools objects)."""

from __future__ import annotations

import contextlib
import io
import shutil

import pytest

from captioner.evaluation.metrics import ALL_METRICS, java_available, reference_agreement, score_captions

REFS = {
    11: [
        "A red circle left of a blue square.",
        "a red circle and a blue square",
        "Two shapes: red circle, blue square",
    ],
    23: ["a green star near the top", "A single green star.", "there is a green star on a black background"],
    35: ["A white triangle below an orange diamond", "an orange diamond above a white triangle", "two shapes"],
}
RESULTS = {11: "a red circle to the left of a blue square", 23: "a green star", 35: "a white triangle and a diamond"}

# Asked of the machine, not of `java_available` (under test here): where Java is, the official path must run.
needs_java = pytest.mark.skipif(shutil.which("java") is None, reason="the official PTB tokenizer and METEOR need Java")


@pytest.mark.slow
@needs_java
def test_agrees_with_official_cocoevalcap():
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.eval import COCOEvalCap
    from pycocoevalcap.meteor.meteor import Meteor
    from pycocoevalcap.rouge.rouge import Rouge
    from pycocotools.coco import COCO

    gt = COCO()
    gt.dataset = {
        "images": [{"id": i} for i in REFS],
        "annotations": [
            {"id": k, "image_id": i, "caption": c}
            for k, (i, c) in enumerate((i, c) for i, cs in REFS.items() for c in cs)
        ],
    }
    with contextlib.redirect_stdout(io.StringIO()):
        gt.createIndex()
        res = gt.loadRes([{"image_id": i, "caption": c} for i, c in RESULTS.items()])
        ev = COCOEvalCap(gt, res)
        ev.params["image_id"] = res.getImgIds()
        # The official evaluate() also runs SPICE, which needs a model download: run the same
        # scorers it runs, on its own tokenizer, the way evaluate() does.
        from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

        ids = ev.params["image_id"]
        tok = PTBTokenizer()
        gts = tok.tokenize({i: gt.imgToAnns[i] for i in ids})
        rs = tok.tokenize({i: res.imgToAnns[i] for i in ids})
        official = dict(zip(["BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4"], Bleu(4).compute_score(gts, rs)[0]))
        official["METEOR"] = Meteor().compute_score(gts, rs)[0]
        official["ROUGE-L"] = Rouge().compute_score(gts, rs)[0]
        official["CIDEr"] = Cider().compute_score(gts, rs)[0]
    ours = score_captions(RESULTS, REFS)
    assert java_available() and ours["official"] is True and ours["tokenizer"] == "ptb"
    for k in ALL_METRICS:
        assert ours[k] == pytest.approx(official[k], abs=1e-9), k


def test_perfect_captions_score_top_marks():
    refs = {i: ["a red circle left of a blue square", "a red circle and a blue square"] for i in (1, 2)}
    scores = score_captions(
        {1: "a red circle left of a blue square", 2: "a red circle and a blue square"}, refs, use_java=False
    )
    assert scores["BLEU-4"] == pytest.approx(1.0)
    assert scores["ROUGE-L"] == pytest.approx(1.0)


def test_python_fallback_without_java():
    scores = score_captions(RESULTS, REFS, use_java=False)
    assert scores["official"] is False and scores["tokenizer"] == "python" and scores["METEOR"] is None
    assert set(ALL_METRICS) <= set(scores)
    assert 0 < scores["BLEU-1"] <= 1 and scores["CIDEr"] > 0


def test_missing_references_rejected():
    with pytest.raises(ValueError, match="no reference"):
        score_captions({99: "x"}, REFS, use_java=False)


def test_reference_agreement_is_the_leave_one_out_score():
    same = {i: [refs[0]] * 3 for i, refs in REFS.items()}
    assert reference_agreement(same, use_java=False)["BLEU-4"] == pytest.approx(1.0)
    agreement = reference_agreement(REFS, use_java=False)
    by_hand = [
        score_captions(
            {i: r[k] for i, r in REFS.items()}, {i: r[:k] + r[k + 1 :] for i, r in REFS.items()}, use_java=False
        )["CIDEr"]
        for k in range(3)
    ]
    assert agreement["CIDEr"] == pytest.approx(sum(by_hand) / 3)
    assert 0 < agreement["BLEU-4"] < 1
    with pytest.raises(ValueError, match="two references"):
        reference_agreement({1: ["one caption"]})
