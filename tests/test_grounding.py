"""Pointing accuracy: attention peaks against object boxes, for COCO categories and synthetic shapes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from captioner.data.boxes import SYNONYMS, GroundingBoxes
from captioner.errors import CaptionerError
from captioner.evaluation.grounding import peak, pointing_accuracy
from captioner.models.preprocess import Preprocess

# A hand-made COCO instances file: one 280×140 image with a person on the left and a dog on the right.
INSTANCES = {
    "images": [{"id": 7, "width": 280, "height": 140, "file_name": "x.jpg"}],
    "categories": [
        {"id": 1, "name": "person"},
        {"id": 18, "name": "dog"},
        {"id": 58, "name": "hot dog"},
        {"id": 37, "name": "sports ball"},
        {"id": 67, "name": "dining table"},
    ],
    "annotations": [
        {"id": 1, "image_id": 7, "category_id": 1, "bbox": [0, 0, 100, 140]},
        {"id": 2, "image_id": 7, "category_id": 18, "bbox": [180, 40, 100, 100]},
    ],
}


def peak_at(row: int, col: int) -> np.ndarray:
    att = np.full((14, 14), 0.001, np.float32)
    att[row, col] = 1.0
    return att


@pytest.fixture()
def boxes(tmp_path):
    path = tmp_path / "instances.json"
    path.write_text(json.dumps(INSTANCES))
    return GroundingBoxes(str(path))


def test_synonyms_map_caption_words_to_categories(boxes):
    for word in ("man", "woman", "people", "person", "boy", "kids"):
        assert boxes.boxes_for(7, word) == [[0, 0, 100, 140]], word
    assert boxes.boxes_for(7, "dogs") == [[180, 40, 100, 100]]
    assert boxes.boxes_for(7, "puppy") == [[180, 40, 100, 100]]
    assert boxes.names_object("ball") and boxes.names_object("table")  # last word of a category name
    assert not boxes.names_object("hot")
    assert boxes.boxes_for(7, "dog") == [[180, 40, 100, 100]]  # "hot dog" does not claim "dog"
    assert not boxes.names_object("riding")
    assert SYNONYMS["bike"] == "bicycle"


def test_pointing_hits_misses_and_chance(boxes):
    words = ["a", "man", "and", "his", "dog", "near", "a", "table"]
    att = np.stack(
        [
            peak_at(7, 2),
            peak_at(7, 3),
            peak_at(0, 0),
            peak_at(0, 0),
            peak_at(10, 12),  # dog: inside its box (x ≈ 250, y ≈ 105)
            peak_at(0, 0),
            peak_at(0, 0),
            peak_at(5, 5),
        ]
    )
    out = pointing_accuracy({7: (words, att)}, boxes)
    assert out["words"] == 2 and out["pointing"] == 1.0
    assert out["unmatched"] == 1  # "table" names an object that is not in the image
    assert out["chance"] == pytest.approx((100 * 140 / (280 * 140) + 100 * 100 / (280 * 140)) / 2, rel=1e-3)
    miss = pointing_accuracy({7: (["dog"], np.stack([peak_at(7, 2)]))}, boxes)
    assert miss["pointing"] == 0.0 and miss["by_word"] == {"dog": [0, 1]}


def test_misses_say_whether_the_map_was_on_another_object(boxes):
    """A miss on the person's box is a word naming another object than the one looked at; a miss
    on the empty middle of the image is a map on nothing."""
    words = ["dog", "dog", "dog", "man"]
    att = np.stack([peak_at(10, 12), peak_at(7, 2), peak_at(7, 7), peak_at(7, 2)])  # hit, on the man, on nothing, hit
    out = pointing_accuracy({7: (words, att)}, boxes)
    assert out["pointing"] == 0.5
    assert out["missed_on_another_object"] == 0.25 and out["missed_on_no_object"] == 0.25


def test_peak_is_the_drawn_maps_peak_not_one_stray_cell(boxes):
    # A 3×3 cluster on the dog (cells 9-11 × 11-13) and one single, slightly stronger cell on the person.
    att = np.full((14, 14), 0.001, np.float32)
    att[9:12, 11:14] = 0.8
    att[7, 2] = 1.0
    x, y = peak(att)
    assert 11 / 14 < x < 14 / 14 and 9 / 14 < y < 12 / 14
    assert pointing_accuracy({7: (["dog"], att[None])}, boxes)["pointing"] == 1.0
    # Alone, the single cell is the peak, at its centre.
    x, y = peak(peak_at(7, 2))
    assert abs(x - 2.5 / 14) < 0.5 / 14 and abs(y - 7.5 / 14) < 0.5 / 14


def test_centre_crop_moves_the_grid(boxes):
    """With the paper's centre crop the grid covers the middle of a wide image, not all of it."""
    crop = Preprocess(crop=True)
    # Column 0 of a centre-cropped 280x140 image lies at x ≈ 70 + 4.5, inside the person box.
    out = pointing_accuracy({7: (["man"], np.stack([peak_at(7, 0)]))}, boxes, crop)
    assert out["pointing"] == 1.0
    out = pointing_accuracy({7: (["man"], np.stack([peak_at(7, 8)]))}, boxes, crop)
    assert out["pointing"] == 0.0


def test_synthetic_boxes_name_colours_and_shapes(scenes):
    boxes = GroundingBoxes(str(scenes / "boxes.json"))
    coco = boxes.coco
    ann = next(iter(coco.anns.values()))
    shape = coco.cats[ann["category_id"]]["name"]
    assert ann["bbox"] in boxes.boxes_for(ann["image_id"], ann["color"])
    assert ann["bbox"] in boxes.boxes_for(ann["image_id"], shape)


def test_bad_boxes_file_is_explained(tmp_path):
    path = tmp_path / "b.json"
    path.write_text(json.dumps({"images": [], "categories": [], "annotations": [{"image_id": 1}]}))
    with pytest.raises(CaptionerError, match=r"b.json: annotations\[0\]"):
        GroundingBoxes(str(path))


def test_kinds_and_lookahead(boxes):
    # "a" already looks at the man it names next; "and" and "his" look at the dog named after them.
    words = ["a", "man", "and", "his", "dog"]
    att = np.stack([peak_at(7, 2), peak_at(7, 2), peak_at(10, 12), peak_at(10, 12), peak_at(7, 2)])
    out = pointing_accuracy({7: (words, att)}, boxes)
    assert out["by_kind"] == {"category": 0.5}  # man hit, dog missed (it looks at the man)
    # words with an object word after them: a → man (hit), man → dog (miss), and → dog, his → dog (hits)
    assert out["lookahead_words"] == 4 and out["lookahead"] == 0.75


def test_two_objects_asks_whether_the_maps_move_to_the_second_object(boxes):
    words = ["a", "man", "and", "his", "dog"]
    on_man, on_dog = peak_at(7, 2), peak_at(10, 12)
    stays = pointing_accuracy({7: (words, np.stack([on_man, on_man, on_man, on_man, on_man]))}, boxes)
    assert stays["pointing"] == 0.5 and stays["two_objects"] == 0.0 and stays["two_object_captions"] == 1
    moves = pointing_accuracy({7: (words, np.stack([on_man, on_man, on_dog, on_dog, on_dog]))}, boxes)
    assert moves["two_objects"] == 1.0
    # A caption that names one object is not asked.
    one = pointing_accuracy({7: (["a", "dog"], np.stack([on_dog, on_dog]))}, boxes)
    assert one["two_objects"] is None and one["two_object_captions"] == 0


def two_shapes(tmp_path, left: tuple[str, str], right: tuple[str, str]) -> GroundingBoxes:
    """Image 1, 280×140: a (shape, colour) on the left, where `peak_at(7, 2)` lies, and one on the right, where
    `peak_at(10, 12)` lies."""
    path = tmp_path / "boxes.json"
    scene = {
        "images": [{"id": 1, "width": 280, "height": 140}],
        "categories": [{"id": 1, "name": left[0]}, {"id": 2, "name": right[0]}],
        "annotations": [
            {"image_id": 1, "category_id": 1, "bbox": [0, 0, 100, 140], "color": left[1]},
            {"image_id": 1, "category_id": 2, "bbox": [180, 40, 100, 100], "color": right[1]},
        ],
    }
    path.write_text(json.dumps(scene))
    return GroundingBoxes(str(path))


def test_a_colour_word_naming_both_objects_does_not_count_as_moving(tmp_path):
    boxes = two_shapes(tmp_path, ("triangle", "yellow"), ("square", "yellow"))
    words = ["a", "yellow", "triangle", "and", "a", "yellow", "square"]
    on_square = peak_at(10, 12)
    out = pointing_accuracy({1: (words, np.stack([on_square] * len(words)))}, boxes)
    assert out["pointing"] == 0.75  # both "yellow"s and "square" hit
    assert out["two_objects"] == 0.0 and out["two_object_captions"] == 1


def test_pointing_on_right_phrases_leaves_out_the_words_of_an_object_the_caption_got_wrong(tmp_path):
    boxes = two_shapes(tmp_path, ("circle", "red"), ("square", "blue"))
    # "red square" names no object: its maps, read from the red circle, miss the square and hit the red.
    words = ["a", "red", "square", "and", "a", "blue", "square"]
    on_circle, on_square = peak_at(7, 2), peak_at(10, 12)
    maps = np.stack([on_circle, on_circle, on_circle, on_square, on_square, on_square, on_square])
    out = pointing_accuracy({1: (words, maps)}, boxes)
    assert out["pointing"] == 0.75 and out["words"] == 4
    assert out["pointing_right_phrases"] == 1.0 and out["right_phrase_words"] == 2
