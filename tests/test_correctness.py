"""`fit --boxes`: attention correctness from object boxes, for the training images only."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from captioner.data.batches import CaptionBatches
from captioner.data.boxes import BoxTargets, GroundingBoxes, grid_cells
from captioner.data.dataset import CaptionData
from captioner.errors import CaptionerError
from captioner.models.checkpoint import load_checkpoint
from captioner.models.decoder import DecoderConfig
from captioner.objectives.terms import attention_correctness
from captioner.train.config import TrainConfig
from captioner.train.trainer import FitJob, fit


def test_grid_cells_of_boxes():
    cells = grid_cells([[50, 0, 50, 100]], (0, 0, 100, 100), 4).reshape(4, 4)
    assert cells[:, 2:].all() and not cells[:, :2].any()  # the right half
    tiny = grid_cells([[60, 10, 2, 2]], (0, 0, 100, 100), 4).reshape(4, 4)
    assert tiny.sum() == 1 and tiny[0, 2]  # too small for a centre: the cell holding its centre


def test_the_term_is_minus_the_log_of_the_attention_on_the_object():
    masks = torch.zeros(1, 3, 16, dtype=torch.bool)
    masks[0, [0, 2], :4] = True  # steps 0 and 2 name an object on cells 0-3; step 1 names none
    even = torch.full((1, 3, 16), 1 / 16)
    on = torch.zeros(1, 3, 16)
    on[..., 2] = 1.0
    assert float(attention_correctness(even, masks, 2)) == pytest.approx(-math.log(4 / 16))
    assert float(attention_correctness(on, masks, 2)) == pytest.approx(0.0, abs=1e-9)


def test_targets_are_the_object_words_of_training_images(data_dir, scenes):
    data = CaptionData(str(data_dir))
    boxes = GroundingBoxes(str(scenes / "boxes.json"))
    targets = BoxTargets(data, boxes, data.encoder.preprocess, data.encoder.grid)
    train = {int(i) for i in data.split_images("train")[0]}
    assert targets.words > 0
    for c, step, m in zip(targets.caption[:50], targets.steps[:50], targets.which[:50]):
        image_id = int(data.meta["image_ids"][data.rows[c]])
        word = data.vocab.words[int(data.tokens[c, step + 1])]
        assert image_id in train and boxes.boxes_for(image_id, word)
        size = boxes.size(image_id)
        want = grid_cells(boxes.boxes_for(image_id, word), data.encoder.preprocess.grid_box(*size), 14)
        assert np.array_equal(targets.masks[m], want)
    batch = next(iter(CaptionBatches(data, 8).batches(seed=0, epoch=0)))
    assert batch.boxes is None  # only `fit --boxes` attaches them
    batch = next(iter(CaptionBatches(data, 8, targets=targets).batches(seed=0, epoch=0)))
    B, T = batch.captions.shape
    assert batch.boxes.masks.shape == (B, T - 1, 196) and batch.boxes.masks.any()
    for b, t in zip(*np.nonzero(batch.boxes.masks.any(-1).numpy())):  # each target is its word's cells
        mask = targets.mask_of(int(batch.boxes.images[b]), int(batch.captions[b, t + 1]))
        assert np.array_equal(batch.boxes.masks[b, t].numpy(), mask)


def test_every_object_word_of_a_training_image_has_its_cells_and_held_out_images_none(data_dir, scenes):
    data = CaptionData(str(data_dir))
    boxes = GroundingBoxes(str(scenes / "boxes.json"))
    targets = BoxTargets(data, boxes, data.encoder.preprocess, data.encoder.grid)
    ids, rows = data.split_images("train")
    checked = 0
    for image_id, row in zip(ids[:10], rows[:10]):
        size = boxes.size(int(image_id))
        for word_id, word in enumerate(data.vocab.words):
            found = boxes.boxes_for(int(image_id), word) if boxes.names_object(word) else []
            mask = targets.mask_of(int(row), word_id)
            if not found:
                assert mask is None, word
                continue
            checked += 1
            want = grid_cells(found, data.encoder.preprocess.grid_box(*size), 14)
            assert np.array_equal(mask, want), word
    assert checked > 10
    held = data.split_images("test")[1]
    assert all(targets.mask_of(int(r), w) is None for r in held for w in range(len(data.vocab)))


def test_the_targets_of_predicted_words_are_those_of_the_same_words_in_a_caption(data_dir, scenes):
    data = CaptionData(str(data_dir))
    targets = BoxTargets(data, GroundingBoxes(str(scenes / "boxes.json")), data.encoder.preprocess, 14)
    batch = next(iter(CaptionBatches(data, 8, targets=targets).batches(seed=0, epoch=0)))
    real = np.arange(batch.captions.size(1) - 1)[None, :] < (batch.lengths.numpy() - 1)[:, None]  # (B, T-1)
    # A model that predicts every caption's own next word is taught exactly the caption's targets.
    predicted = batch.captions[:, 1:].numpy()
    got = targets.masks_for_predictions(batch.boxes.images.numpy(), predicted, real)
    assert np.array_equal(got, batch.boxes.masks.numpy()) and got.any()
    # Words naming nothing in the image, and padding, are no targets.
    assert not targets.masks_for_predictions(batch.boxes.images.numpy(), np.zeros_like(predicted), real).any()
    assert not targets.masks_for_predictions(batch.boxes.images.numpy(), predicted, np.zeros_like(real)).any()


@pytest.mark.slow
def test_fit_learns_from_the_boxes_and_refuses_a_file_without_training_images(data_dir, scenes, tmp_path):
    small = DecoderConfig(0, embed_dim=16, hidden_dim=24, attention_dim=12, dropout=0.0)
    cfg = TrainConfig.of(epochs=2, batch_size=8, val_images=4, log_every=1, boxes_choice_weight=10)
    boxes = str(scenes / "boxes.json")
    fit(FitJob(str(data_dir), str(tmp_path / "run"), small, cfg, boxes=boxes, device="cpu", progress_bar=False))
    log = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    terms = [r["boxes"] for r in log if r["event"] == "train"]
    assert terms and np.mean(terms[-5:]) < np.mean(terms[:5])  # attention moves onto the objects
    chosen = [r["boxes_choice"] for r in log if r["event"] == "train"]
    assert len(chosen) == len(terms) and all(math.isfinite(c) for c in chosen) and max(chosen) > 0
    # With boxes the query holds the word just written, unless told otherwise; the model records it.
    decoder = load_checkpoint(str(tmp_path / "run" / "best.pt"))["decoder"]
    assert decoder["word_query"] is True and decoder["decode_sharpness"] == 3.0  # and decodes with sharper maps
    data = CaptionData(str(data_dir))
    held = {int(i) for s in ("val", "test") for i in data.split_images(s)[0]}
    instances = json.loads((scenes / "boxes.json").read_text())
    instances["images"] = [im for im in instances["images"] if im["id"] in held]
    instances["annotations"] = [a for a in instances["annotations"] if a["image_id"] in held]
    (tmp_path / "held.json").write_text(json.dumps(instances))
    with pytest.raises(CaptionerError, match="no word of the training captions names an object boxed there"):
        fit(
            FitJob(
                str(data_dir),
                str(tmp_path / "bad"),
                small,
                TrainConfig.of(epochs=1),
                boxes=str(tmp_path / "held.json"),
                device="cpu",
                progress_bar=False,
            )
        )
