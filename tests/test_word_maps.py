"""`fit --word-maps`: word detectors learnt from the captions, and their peak cells as attention targets."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from captioner.data.batches import CaptionBatches
from captioner.data.boxes import BoxTargets, GroundingBoxes
from captioner.data.dataset import CaptionData
from captioner.errors import CaptionerError
from captioner.models.decoder import DecoderConfig
from captioner.train import word_maps
from captioner.train.config import TrainConfig
from captioner.train.trainer import FitJob, fit


def test_a_target_is_the_peak_cell_and_its_neighbours_within_the_grid():
    assert word_maps.around(0, 4).reshape(4, 4)[:2, :2].all() and word_maps.around(0, 4).sum() == 4
    assert word_maps.around(5, 4).reshape(4, 4)[:3, :3].all() and word_maps.around(5, 4).sum() == 9
    assert word_maps.around(7, 4).reshape(4, 4)[:3, 2:].all() and word_maps.around(7, 4).sum() == 6


def test_auc_ranks_with_ties_and_is_nan_without_both_labels():
    assert word_maps.auc(np.array([0.1, 0.4, 0.35, 0.8]), np.array([0, 0, 1, 1])) == pytest.approx(0.75)
    assert word_maps.auc(np.array([1.0, 1.0, 2.0]), np.array([0, 1, 1])) == pytest.approx(0.75)
    assert np.isnan(word_maps.auc(np.array([0.2, 0.3]), np.array([1, 1])))


def test_the_noisy_or_is_the_chance_some_cell_holds_the_word():
    logits = torch.tensor([[[0.0], [0.0]]])  # two cells at p = 1/2: the image holds the word with 3/4
    present = word_maps.noisy_or_loss(logits, torch.ones(1, 1))
    absent = word_maps.noisy_or_loss(logits, torch.zeros(1, 1))
    assert float(present) == pytest.approx(-np.log(0.75), rel=1e-5)
    assert float(absent) == pytest.approx(-np.log(0.25), rel=1e-5)


def test_targets_given_as_cells_reach_the_batches_at_their_words_steps(data_dir):
    data = CaptionData(str(data_dir))
    c = 0
    row, word = int(data.rows[c]), int(data.tokens[c, 2])  # the caption's second word
    cell = np.zeros(196, dtype=bool)
    cell[37] = True
    targets = BoxTargets.of_cells(data, {(row, word): cell})
    assert targets.names_object[word] and targets.names_object.sum() == 1
    assert np.array_equal(targets.mask_of(row, word), cell)
    masks, rows = targets.for_captions(np.array([c, -1]), data.tokens.shape[1] - 1)
    steps = {t for t in range(masks.shape[1]) if masks[0, t].any()}
    assert 1 in steps and all(int(data.tokens[c, t + 1]) == word for t in steps)
    assert not masks[1].any() and rows[0] == row
    batch = next(iter(CaptionBatches(data, 8, targets=targets).batches(seed=0, epoch=0)))
    assert batch.boxes.masks.sum(-1).max() <= 1


def test_an_untrusted_word_looks_where_its_trusted_neighbours_look_in_that_image():
    start, end, a, hollow, red, blue, square = range(1, 8)
    tokens = np.array(
        [
            [start, a, hollow, red, square, end],  # image 5: "a hollow red square", "a red square"
            [start, a, red, square, end, 0],
            [start, a, square, end, 0, 0],  # image 6: "a square", with no trusted word
            [start, a, red, square, end, 0],  # image 7: a red square and a blue one
            [start, a, blue, square, end, 0],
        ]
    )
    data = SimpleNamespace(rows=np.array([5, 5, 6, 7, 7]), tokens=tokens, lengths=np.array([6, 5, 4, 5, 5]))
    cell = np.eye(4, dtype=bool)
    trusted = {(5, red): cell[2], (7, red): cell[0], (7, blue): cell[3]}
    borrowed = word_maps.borrowed_cells(data, trusted, {hollow, square})
    assert set(borrowed) == {(5, hollow), (5, square), (7, square)}
    assert np.array_equal(borrowed[5, hollow], cell[2]) and np.array_equal(borrowed[5, square], cell[2])
    assert np.array_equal(borrowed[7, square], cell[0] | cell[3])


def test_word_map_targets_are_cells_for_the_content_words_a_training_image_says(data_dir, scenes, caplog):
    data = CaptionData(str(data_dir))
    with caplog.at_level("WARNING", logger=word_maps.log.name):
        targets = word_maps.word_map_targets(data, seed=0)
    assert "--encoder-weights none" in caplog.text  # the random encoder's maps seldom say where: warned
    _, rows = data.split_images("train")
    words = word_maps.content_words(data, rows)
    assert targets.words > 0 and targets.masks.sum(1).min() >= 4  # 3×3 cells around a peak, fewer at the edges
    labels = word_maps.said(rows, word_maps.training_captions(data), words)
    _, val_rows = data.split_images("val")
    val_labels = word_maps.said(val_rows, word_maps.reference_captions(data, "val"), words)
    at = {int(r): (labels, n) for n, r in enumerate(rows)} | {int(r): (val_labels, n) for n, r in enumerate(val_rows)}
    for row, word in targets.index:  # the training images' and the validation images' (map agreement)
        said, n = at[row]
        assert word in words and said[n, words.index(word)]
    assert {row for row, _ in targets.index} & {int(r) for r in val_rows}
    # The random encoder's cells are local: targets land on the named object well above a random cell's chance.
    boxes = GroundingBoxes(str(scenes / "boxes.json"))
    truth = BoxTargets(data, boxes, data.encoder.preprocess, data.encoder.grid)
    named = [(key, m) for key, m in targets.index.items() if truth.mask_of(*key) is not None]
    on = np.mean([(targets.masks[m] & truth.mask_of(*key)).any() for key, m in named])
    chance = np.mean([truth.mask_of(*key).mean() for key, _ in named])
    assert len(named) >= 10 and on >= 2 * chance, (len(named), on, chance)


def test_map_agreement_counts_the_words_with_a_target_whose_map_peaks_on_it(data_dir):
    data = CaptionData(str(data_dir))
    cells = np.zeros((2, 196), dtype=bool)
    cells[0, 37] = cells[1, 100] = True
    targets = BoxTargets.of_cells(data, {(3, 7): cells[0], (4, 7): cells[1]})
    on, off = np.eye(196)[37], np.eye(196)[150]
    hyps = {
        30: SimpleNamespace(tokens=[5, 7, 9], attention=np.stack([off, on, off])),  # 7 peaks on its cell: a hit
        40: SimpleNamespace(tokens=[7, 7], attention=np.stack([on, np.eye(196)[100]])),  # a miss, then a hit
        50: SimpleNamespace(tokens=[7], attention=on[None]),  # no target in this image
    }
    assert word_maps.agreement(targets, {30: 3, 40: 4, 50: 5}, hyps, grid=14) == (2, 3)


def test_fit_with_word_maps_trains_the_attention_term_and_refuses_boxes_beside_them(data_dir, scenes, tmp_path):
    model = DecoderConfig(0, embed_dim=32, hidden_dim=48, attention_dim=24)
    cfg = TrainConfig.of(epochs=1, batch_size=8, val_beam_size=1, word_maps=True)
    fit(FitJob(str(data_dir), str(tmp_path / "run"), model, cfg, device="cpu", progress_bar=False))
    saved = torch.load(tmp_path / "run" / "last.pt", weights_only=False)
    assert saved["train"]["terms"]["word_maps"] and saved["train"]["terms"]["consistency"] == 1  # the data has views
    assert saved["decoder"]["word_query"]
    log = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert '"boxes"' in log
    validations = [json.loads(line) for line in log.splitlines() if '"val"' in line]
    assert validations and all(v["map_agreement"] is None or 0 <= v["map_agreement"] <= 1 for v in validations)
    with pytest.raises(CaptionerError, match="--word-maps"):
        fit(FitJob(str(data_dir), str(tmp_path / "two"), model, cfg, boxes=str(scenes / "boxes.json"), device="cpu"))
    paper = TrainConfig.of(epochs=1, word_maps=True, paper=True)
    with pytest.raises(CaptionerError, match="--word-maps"):
        fit(FitJob(str(data_dir), str(tmp_path / "three"), model, paper, device="cpu"))
