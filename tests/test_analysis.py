"""The notebooks' analysis helpers: statistics, logs, dataset summaries and figures."""

from __future__ import annotations

import json
import math
import os
import shutil

import numpy as np
import pytest
from matplotlib.figure import Figure
from pycocotools.coco import COCO

from captioner.data.boxes import GroundingBoxes
from captioner.data.dataset import CaptionData
from captioner.decoding.settings import Decoding
from captioner.errors import CaptionerError
from captioner.evaluation.metrics import caption_split
from captioner.models.decoder import DecoderConfig
from captioner.models.vocab import Vocabulary
from captioner.serve.api import Caption, Captioner
from captioner.train.config import TrainConfig
from tools.lab import analysis, detectors, plots, recipes


def _caption(words: list[str], attention: np.ndarray) -> Caption:
    return Caption(text=" ".join(words), words=words, score=-1.0, attention=attention)


def _write_log(path, records, tail: str = "") -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)


# attention statistics


def test_attention_entropy_is_zero_for_one_cell_and_log_L_when_even():
    uniform = np.full((4, 4), 1 / 16)
    one_hot = np.zeros((4, 4))
    one_hot[2, 1] = 1.0
    half = np.zeros((4, 4))
    half[0, :2] = 0.5
    att = np.stack([uniform, one_hot, half])  # (3, 4, 4)
    h = analysis.attention_entropy(att)
    np.testing.assert_allclose(h, [math.log(16), 0.0, math.log(2)], atol=1e-9)
    np.testing.assert_allclose(analysis.attention_entropy(att, normalize=True), [1.0, 0.0, 0.25], atol=1e-9)
    # The flat (n, L) layout gives the same numbers.
    np.testing.assert_allclose(analysis.attention_entropy(att.reshape(3, 16)), h)
    assert analysis.attention_entropy(np.zeros((0, 4, 4))).shape == (0,)  # a caption of no words


def test_attention_peak_and_stats_over_captions():
    rng = np.random.default_rng(0)
    a = rng.random((3, 7, 7))
    a /= a.sum((1, 2), keepdims=True)
    b = np.zeros((2, 7, 7))
    b[:, 3, 3] = 1.0
    np.testing.assert_allclose(analysis.attention_peak(a), a.reshape(3, -1).max(1))
    empty = _caption([], np.zeros((0, 7, 7)))
    split = recipes.SplitCaption(1, "x.png", _caption(["red", "square"], b))
    stats = analysis.attention_stats([_caption(["a", "red", "circle"], a), empty, split])
    assert stats["entropy"].shape == stats["peak"].shape == (5,)
    np.testing.assert_allclose(stats["peak"][3:], 1.0)
    np.testing.assert_allclose(stats["entropy"][3:], 0.0, atol=1e-9)
    assert np.all((stats["entropy"][:3] > 0.5) & (stats["entropy"][:3] <= 1.0))


# training logs


def test_training_log_keeps_the_later_record_of_a_resumed_step_and_skips_a_partial_line(tmp_path):
    log = tmp_path / "metrics.jsonl"
    _write_log(
        log,
        [
            {"event": "start", "step": 0, "epoch": 0, "batches_per_epoch": 4},
            {"event": "train", "step": 2, "epoch": 0, "lr": 1e-3, "loss": 4.0, "nll": 4.0, "penalty": 0.0},
            {"event": "train", "step": 4, "epoch": 0, "lr": 1e-3, "loss": 3.0, "nll": 3.0, "penalty": 0.0},
            {"event": "val", "step": 4, "epoch": 1, "BLEU-4": 0.1, "CIDEr": 0.2, "lr": 1e-3, "example": "a"},
            {"event": "train", "step": 6, "epoch": 1, "lr": 1e-3, "loss": 9.0, "nll": 9.0, "penalty": 0.0},
            # killed here, resumed from the checkpoint at step 4: step 6 comes again
            {"event": "start", "step": 4, "epoch": 1, "resume": True, "batches_per_epoch": 4},
            {"event": "train", "step": 6, "epoch": 1, "lr": 1e-3, "loss": 2.0, "nll": 1.5, "penalty": 0.5},
            {"event": "train", "step": 8, "epoch": 1, "lr": 1e-3, "loss": 1.0, "nll": 0.5, "penalty": 0.5},
            {"event": "val", "step": 8, "epoch": 2, "BLEU-4": 0.3, "CIDEr": 0.5, "lr": 5e-4, "example": "b"},
            {"event": "end", "step": 8, "epoch": 2, "best": 0.5},
        ],
        tail='{"event": "train", "st',
    )
    out = analysis.read_training_log(str(tmp_path))  # the run directory works too
    assert out.batches_per_epoch == 4
    np.testing.assert_array_equal(out.train["step"], [2, 4, 6, 8])
    np.testing.assert_array_equal(out.train["loss"], [4.0, 3.0, 2.0, 1.0])
    np.testing.assert_array_equal(out.train["epoch"], [0.5, 1.0, 1.5, 2.0])
    assert "example" not in out.val  # text fields are not columns
    ep = out.per_epoch()
    np.testing.assert_array_equal(ep["epoch"], [1.0, 2.0])
    np.testing.assert_array_equal(ep["loss"], [3.5, 1.5])
    np.testing.assert_array_equal(ep["nll"], [3.5, 1.0])
    np.testing.assert_array_equal(ep["CIDEr"], [0.2, 0.5])
    np.testing.assert_array_equal(ep["lr"], [1e-3, 1e-3])


def test_training_log_errors_name_the_problem(tmp_path):
    with pytest.raises(CaptionerError, match="no such training log"):
        analysis.read_training_log(str(tmp_path / "missing.jsonl"))
    log = tmp_path / "metrics.jsonl"
    _write_log(
        log,
        [
            {"event": "start", "batches_per_epoch": 2},
            {"event": "train", "step": 1, "epoch": 0, "lr": 1e-3, "loss": 1.0},
        ],
    )
    with pytest.raises(CaptionerError, match="no validation"):
        analysis.read_training_log(str(log))
    log.write_text('{"event": "start"}\nnot json\n{"event": "end"}\n')
    with pytest.raises(CaptionerError, match="line 2"):
        analysis.read_training_log(str(log))


def test_training_figure_of_a_real_run(small_run):
    log = analysis.read_training_log(str(small_run / "metrics.jsonl"))
    np.testing.assert_array_equal(log.val["epoch"], [1.0, 2.0])  # two full epochs
    assert np.all(np.diff(log.train["step"]) > 0)
    fig = plots.training_figure(log)
    assert isinstance(fig, Figure)
    axes = {ax.get_title(): ax for ax in fig.axes}
    bleu = axes["validation BLEU-4 (generated captions)"].lines[0]
    np.testing.assert_allclose(bleu.get_ydata(), log.val["BLEU-4"])
    np.testing.assert_allclose(axes["learning rate"].lines[0].get_ydata(), log.train["lr"])


def test_self_critical_log_shows_the_reward_curve(tmp_path):
    """An SCST run's loss is a REINFORCE surrogate: the figure and table show the reward instead."""
    scst = lambda step, reward: {
        "event": "train",
        "step": step,
        "epoch": 0,
        "lr": 5e-5,
        "loss": -0.1,
        "reward": reward,
        "baseline": reward - 0.1,
        "entropy": 1.0,
    }
    _write_log(
        tmp_path / "metrics.jsonl",
        [
            {"event": "start", "step": 0, "epoch": 0, "batches_per_epoch": 2, "train": {"objective": "scst"}},
            scst(1, 1.0),
            scst(2, 2.0),
            {"event": "val", "step": 2, "epoch": 1, "BLEU-4": 0.1, "CIDEr": 0.2, "lr": 5e-5},
            scst(3, 3.0),
            scst(4, 5.0),
            {"event": "val", "step": 4, "epoch": 2, "BLEU-4": 0.2, "CIDEr": 0.4, "lr": 5e-5},
        ],
    )
    log = analysis.read_training_log(str(tmp_path))
    assert log.objective == "scst"
    np.testing.assert_array_equal(log.per_epoch()["reward"], [1.5, 4.0])
    axes = {ax.get_title(): ax for ax in plots.training_figure(log).axes}
    reward = axes["reward of sampled captions (CIDEr-D, training references)"]
    np.testing.assert_array_equal(reward.lines[0].get_ydata(), [1, 2, 3, 5])
    np.testing.assert_array_equal(reward.lines[1].get_ydata(), [0.9, 1.9, 2.9, 4.9])


# datasets


def test_vocabulary_coverage_follows_vocabulary_build():
    tokens = [["a", "red", "circle"], ["a", "blue", "circle"], ["a", "red", "star"], ["an", "orange", "star"]]
    cov = analysis.vocabulary_coverage(tokens, [1, 2, 3, 4])
    for m, words in zip(cov["min_count"], cov["words"]):
        assert words == len(Vocabulary.build(tokens, min_count=int(m))) - 4  # without the specials
    # counts: a 3, red 2, circle 2, star 2, blue 1, an 1, orange 1 (12 occurrences)
    np.testing.assert_allclose(cov["tokens"], [1.0, 9 / 12, 3 / 12, 0.0])
    np.testing.assert_allclose(cov["captions"], [1.0, 0.5, 0.0, 0.0])  # no caption is all "a"


def test_caption_lengths_and_their_histogram():
    lengths = analysis.caption_lengths([["a"] * 3, ["a"] * 5, ["a"] * 3, []])
    np.testing.assert_array_equal(lengths, [3, 5, 3, 0])
    values, counts = analysis.length_histogram(lengths)
    np.testing.assert_array_equal(values, np.arange(6))
    np.testing.assert_array_equal(counts, [1, 0, 0, 2, 0, 1])


def test_coco_examples_pair_images_with_their_captions(scenes):
    coco = COCO(str(scenes / "captions.json"))
    items = analysis.coco_examples(coco, str(scenes / "images"), k=3, seed=1)
    assert len(items) == 3
    by_file = {im["file_name"]: im["id"] for im in coco.imgs.values()}
    for path, caps in items:
        assert os.path.isfile(path)
        assert caps == [a["caption"].strip() for a in coco.imgToAnns[by_file[os.path.basename(path)]]]
        assert len(caps) == 5
    tokens = analysis.coco_tokens(coco)
    assert len(tokens) == len(coco.anns) and all(t == [w.lower() for w in t] for t in tokens)


# runs and captions from the feature cache


def test_caption_split_images_match_evaluation(small_run, data_dir):
    ckpt = str(small_run / "best.pt")
    out = recipes.caption_split_images(ckpt, str(data_dir), "test", beam_size=2)
    cap = Captioner.load(ckpt, build_encoder=False)
    texts, _ = caption_split(
        cap.decoder, CaptionData(str(data_dir)), cap.vocab, "test", decoding=Decoding(beam_size=2), max_len=cap.max_len
    )
    assert [s.image_id for s in out] == sorted(texts)
    for s in out:
        assert s.caption.text == texts[s.image_id] and os.path.isfile(s.path)
        assert s.caption.attention.shape == (len(s.caption.words), 14, 14)
        np.testing.assert_allclose(s.caption.attention.sum((1, 2)), 1.0, atol=1e-3)
        assert s.caption.locations is None
    hard = recipes.caption_split_images(ckpt, str(data_dir), "test", mode="argmax", max_images=2)
    assert len(hard) == 2
    for s in hard:
        assert len(s.caption.locations) == len(s.caption.words)
        assert all(0 <= r < 14 and 0 <= c < 14 for r, c in s.caption.locations)


def test_train_or_load_reuses_a_finished_run(small_run, data_dir, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    for name in ("best.pt", "metrics.jsonl"):
        shutil.copy(small_run / name, run / name)
    log = (run / "metrics.jsonl").read_text()
    assert recipes.train_or_load(str(data_dir), str(run), recipes.recipe("soft")) == str(run / "best.pt")
    assert (run / "metrics.jsonl").read_text() == log  # nothing was trained
    assert not (run / "last.pt").exists()


def test_synthetic_data_is_made_once(tmp_path):
    rec = recipes.Recipe(6, 0, 32, 1, DecoderConfig(0), TrainConfig.of(), name="tiny")
    scenes, data = recipes.synthetic_data(str(tmp_path), rec)
    meta = os.path.join(data, "meta.json")
    stamp = os.stat(meta).st_mtime_ns
    assert recipes.synthetic_data(str(tmp_path), rec) == (scenes, data)
    assert os.stat(meta).st_mtime_ns == stamp
    assert CaptionData(data).encoder.grid == 2  # 32 px → a 2×2 grid
    assert len(recipes.scene_images(str(tmp_path), 3, seed=4)) == 3


def test_work_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(recipes.WORK_ENV, str(tmp_path / "nb"))
    assert recipes.work_dir() == str(tmp_path / "nb") and (tmp_path / "nb").is_dir()


# tables and figures


def test_tables_align_and_show_missing_values():
    text = analysis.metrics_table(
        {
            "soft": {"BLEU-4": 1e-78, "CIDEr": 0.5, "grounding": {"chance": 0.1}, "pointing": 0.25},
            "hard": {"BLEU-4": 0.2, "CIDEr": 1.25, "grounding": None, "pointing": None},
        },
        keys=("BLEU-4", "CIDEr", "pointing"),
    )
    header, soft, hard = text.splitlines()
    assert header.split() == ["model", "BLEU-4", "CIDEr", "pointing", "chance"]
    assert soft.split() == ["soft", "0.000", "0.500", "0.250", "0.100"]
    assert hard.split() == ["hard", "0.200", "1.250", "-", "-"]
    assert len({len(line) for line in text.splitlines()}) == 1
    assert analysis.format_table({"lr": [5e-4]}).splitlines()[1].strip() == "0.0005"


def test_captioned_images_figure_puts_each_text_under_its_image(scenes):
    paths = sorted(str(p) for p in (scenes / "images").iterdir())[:5]
    fig = plots.captioned_images_figure([(p, [f"caption {i}", "second line"]) for i, p in enumerate(paths)], columns=2)
    image_axes = [ax for ax in fig.axes if ax.images]
    assert len(image_axes) == 5
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert texts == [f"caption {i}\nsecond line" for i in range(5)]
    # Each text block starts below its image.
    for img_ax, txt_ax in zip(fig.axes[0::2], fig.axes[1::2]):
        assert txt_ax.get_position().y1 <= img_ax.get_position().y0 + 1e-6


def test_entropy_figure_draws_each_words_entropy():
    rng = np.random.default_rng(1)
    att = rng.random((4, 7, 7))
    att /= att.sum((1, 2), keepdims=True)
    fig = plots.entropy_figure([_caption(["a", "red", "big", "circle"], att)])
    bars = [p.get_height() for p in fig.axes[0].patches]
    np.testing.assert_allclose(bars, analysis.attention_entropy(att))
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["a", "red", "big", "circle"]


def test_model_comparison_figure_shows_the_metrics():
    one = np.zeros((2, 7, 7))
    one[:, 0, 0] = 1.0
    metrics = {
        "soft": {"BLEU-4": 0.2, "CIDEr": 0.8, "grounding": {"pointing": 0.5, "chance": 0.1, "words": 4}},
        "hard": {"BLEU-4": 0.3, "CIDEr": 0.6, "grounding": {"pointing": 0.25, "chance": 0.2, "words": 8}},
    }
    captions = {"soft": [_caption(["a", "b"], np.full((2, 7, 7), 1 / 49))], "hard": [_caption(["a", "b"], one)]}
    fig = plots.model_comparison_figure(metrics, captions)
    quality, _, _, pointing = fig.axes
    heights = [p.get_height() for p in quality.patches]
    assert heights == [0.2, 0.8, 0.3, 0.6]
    assert [p.get_height() for p in pointing.patches] == [0.5, 0.25]
    chance = [seg[0][1] for coll in pointing.collections for seg in coll.get_segments()]
    assert chance == [0.1, 0.2]


def test_dataset_figure_histogram_matches_the_lengths():
    lengths = np.array([3, 3, 4, 7, 7, 7, 25])
    cov = analysis.vocabulary_coverage([["a", "b"], ["a"]], range(1, 4))
    fig = plots.dataset_figure(lengths, cov, max_len=20, min_count=2)
    hist = fig.axes[0]
    heights = {int(round(p.get_x() + p.get_width() / 2)): p.get_height() for p in hist.patches if p.get_height()}
    assert heights == {3: 2, 4: 1, 7: 3, 25: 1}
    assert "14.3% left out" in hist.get_legend().get_texts()[0].get_text()


# word detectors over the cells


def test_detectors_taught_by_the_boxes_find_the_objects_and_caption_labels_follow_the_captions(data_dir, scenes):
    data, boxes = CaptionData(str(data_dir)), GroundingBoxes(str(scenes / "boxes.json"))
    words = detectors.object_words(data, boxes)
    names = {data.vocab.words[w] for w in words}
    assert {"red", "circle"} <= names
    _, rows = data.split_images("train")
    labels = detectors.caption_labels(data, rows[:3], words)
    for n, row in enumerate(rows[:3]):
        said = {data.vocab.words[int(t)] for r, tokens in zip(data.rows, data.tokens) if r == row for t in tokens}
        assert {data.vocab.words[w] for w, y in zip(words, labels[n]) if y} == said & names
    found = detectors.measure(str(data_dir), str(scenes / "boxes.json"), "boxes", epochs=40)
    assert found["scored"] > 0 and found["pointing"] >= 0.6, found


def test_word_map_targets_are_one_cell_at_the_peak_of_each_said_words_map(data_dir, scenes):
    data, boxes = CaptionData(str(data_dir)), GroundingBoxes(str(scenes / "boxes.json"))
    words = detectors.object_words(data, boxes)
    _, rows = data.split_images("train")
    maps = detectors.cell_labels(data, boxes, rows[:4], words)  # maps that are the objects' own cells
    said = detectors.caption_labels(data, rows[:4], words) * maps.any(1)
    found = detectors.word_map_instances(data, boxes, rows[:4], maps, words, said)
    category = {c["id"]: c["name"] for c in found["categories"]}
    assert len(found["annotations"]) == said.sum() > 0
    for a in found["annotations"]:
        x, y, w, h = a["bbox"]
        named = boxes.boxes_for(a["image_id"], a.get("color") or category[a["category_id"]])
        assert any(bx <= x + w / 2 <= bx + bw and by <= y + h / 2 <= by + bh for bx, by, bw, bh in named), a
