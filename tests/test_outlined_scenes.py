"""The outlined-shapes scene generator: COCO-format files, boxes inside their images, captions that name
the objects in them, the same files for the same seed, and a set that `prepare` accepts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import prepare_scenes
from PIL import Image

from captioner.data.boxes import BoxTargets, GroundingBoxes
from captioner.data.dataset import CaptionData
from tools.outlined import PALETTE, SHAPES, generate

N = 12


@pytest.fixture(scope="module")
def scenes(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("outlined")
    generate(out, N, seed=5)
    return out


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def test_every_image_exists_opens_and_sizes_vary(scenes):
    sizes = []
    for im in load(scenes / "captions.json")["images"]:
        with Image.open(scenes / "images" / im["file_name"]) as img:
            assert img.size == (im["width"], im["height"]) and img.mode == "RGB"
            sizes.append(img.size)
    assert len(sizes) == N and all(160 <= s <= 640 for size in sizes for s in size)
    ratios = [w / h for w, h in sizes]
    assert min(ratios) < 0.8 and max(ratios) > 1.25 and len(set(sizes)) > N // 2


def test_the_split_covers_every_image_once(scenes):
    images = load(scenes / "captions.json")["images"]
    entries = load(scenes / "splits.json")["images"]
    assert sorted(e["cocoid"] for e in entries) == sorted(im["id"] for im in images)
    assert sorted(e["filename"] for e in entries) == sorted(im["file_name"] for im in images)
    assert {e["split"] for e in entries} == {"train", "val", "test"}
    assert all(len(e["sentences"]) == 5 for e in entries)


def test_boxes_lie_inside_and_captions_name_their_objects(scenes):
    caps, boxes = load(scenes / "captions.json"), load(scenes / "boxes.json")
    assert [c["name"] for c in boxes["categories"]] == list(SHAPES)
    names = {c["id"]: c["name"] for c in boxes["categories"]}
    sizes = {im["id"]: (im["width"], im["height"]) for im in caps["images"]}
    objects = {image_id: [] for image_id in sizes}
    for a in boxes["annotations"]:
        x, y, w, h = a["bbox"]
        W, H = sizes[a["image_id"]]
        assert 0 <= x <= W - w and 0 <= y <= H - h and w > 0 and h > 0
        objects[a["image_id"]].append((a["color"], names[a["category_id"]]))
    assert all(1 <= len(objs) <= 3 for objs in objects.values())
    for a in caps["annotations"]:
        words = a["caption"].lower().replace(",", " ").replace(".", " ").split()
        objs = objects[a["image_id"]]
        assert {s for _, s in objs} <= set(words) and {c for c, _ in objs} <= set(words), a["caption"]
        assert {w for w in words if w in SHAPES or w in PALETTE} == {x for o in objs for x in o}, a["caption"]


def test_the_seed_decides_the_files(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    generate(a, 4, seed=9, scale=0.3), generate(b, 4, seed=9, scale=0.3), generate(c, 4, seed=10, scale=0.3)
    for name in ("captions.json", "boxes.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
        assert (a / name).read_bytes() != (c / name).read_bytes()


@pytest.mark.slow  # prepare encodes the images: about 13 s here
def test_prepare_accepts_the_set_and_its_boxes(scenes, tmp_path):
    prepare_scenes(scenes, tmp_path, min_count=1)
    data = CaptionData(str(tmp_path))
    assert len(data.meta["image_ids"]) == N
    boxes = GroundingBoxes(str(scenes / "boxes.json"))
    assert all(image_id in boxes for image_id in data.meta["image_ids"])
    targets = BoxTargets(data, boxes, data.encoder.preprocess, data.encoder.grid)
    assert targets.words > 0  # training captions' colour and shape words find their boxes
