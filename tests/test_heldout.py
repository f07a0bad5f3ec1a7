"""The independent held-out scene generator: COCO-format files whose captions are true of the images."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from captioner.data.coco import load_dataset
from tools.heldout import SHAPES, generate
from tools.heldout_drawing import PALETTE


@pytest.fixture(scope="module")
def scenes(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("heldout")
    generate(out, 40, seed=3)
    return out


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def test_files_are_coco_and_karpathy(scenes):
    records, skipped = load_dataset(
        [str(scenes / "captions.json")], [str(scenes / "images")], str(scenes / "splits.json")
    )
    assert len(records) == 40 and not skipped.report()
    assert {r.split for r in records} == {"train", "val", "test"}
    assert all(len(r.captions) == 5 for r in records)
    ids = [r.image_id for r in records]
    assert sorted(ids) != list(range(min(ids), min(ids) + len(ids)))  # ids are not an index


def test_images_vary_in_size_mode_and_format(scenes):
    info = []
    for im in load(scenes / "captions.json")["images"]:
        with Image.open(scenes / "images" / im["file_name"]) as img:
            assert img.size == (im["width"], im["height"])
            info.append((img.mode, img.format, img.size))
    modes = Counter(m for m, _, _ in info)
    assert {"RGB", "L", "RGBA"} <= set(modes)
    assert {"JPEG", "PNG"} <= {f for _, f, _ in info}
    ratios = [w / h for _, _, (w, h) in info]
    assert min(ratios) < 0.7 and max(ratios) > 1.4  # far from square both ways
    assert min(min(s) for _, _, s in info) < 112 and max(max(s) for _, _, s in info) > 400


def test_captions_name_the_objects_in_the_boxes(scenes):
    caps = load(scenes / "captions.json")
    boxes = load(scenes / "boxes.json")
    names = {c["id"]: c["name"] for c in boxes["categories"]}
    objects = {im["id"]: [] for im in caps["images"]}
    for a in boxes["annotations"]:
        objects[a["image_id"]].append((a["color"], names[a["category_id"]], a["bbox"]))
    sizes = {im["id"]: (im["width"], im["height"]) for im in caps["images"]}
    gray = {im["id"] for im in caps["images"] if Image.open(scenes / "images" / im["file_name"]).mode == "L"}
    for a in caps["annotations"]:
        words = a["caption"].lower().replace(",", " ").replace(".", " ").split()
        objs = objects[a["image_id"]]
        assert 1 <= len(objs) <= 3
        named = [w for w in words if w in SHAPES]
        assert sorted(named) == sorted(s for _, s, _ in objs), a["caption"]
        colours = [w for w in words if w in PALETTE]
        assert colours == [] if a["image_id"] in gray else sorted(colours) == sorted(c for c, _, _ in objs)
    for image_id, objs in objects.items():
        W, H = sizes[image_id]
        for _, _, (x, y, w, h) in objs:
            assert x >= 0 and y >= 0 and x + w <= W and y + h <= H
            assert 0.14 * min(W, H) <= w <= 0.36 * min(W, H)


def test_same_seed_same_scenes(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    generate(a, 5, seed=9), generate(b, 5, seed=9)
    assert load(a / "captions.json") == load(b / "captions.json")
    first = load(a / "captions.json")["images"][0]["file_name"]
    assert np.array_equal(np.asarray(Image.open(a / "images" / first)), np.asarray(Image.open(b / "images" / first)))
    generate(tmp_path / "c", 5, seed=10)
    assert load(tmp_path / "c" / "captions.json") != load(a / "captions.json")
