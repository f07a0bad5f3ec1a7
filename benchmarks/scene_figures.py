"""How right a model is about scenes it never saw, from `captioner caption --attention --jsonl LOG`.

Given the log and the scenes' boxes (a COCO instances file with a "color" per box: a synthetic
set's boxes.json, or `to_instances.py`'s output for the independent generator), it reports:

- scenes named exactly right: every object's colour and shape, none missing, none extra
  (`tools.judge`);
- pointing: the share of object words whose map peaks on such an object (`evaluation.grounding`);
- two-object reach: of the captions naming two or more objects (colour word then shape word), the
  share where every named object is one of the scene's and its shape word's map peaks on it (and,
  stricter, where its colour word's map does too).

    python benchmarks/scene_figures.py LOG.jsonl SCENES/boxes.json [--images SCENES/images]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from captioner.data.boxes import GroundingBoxes
from captioner.evaluation.grounding import peak, pointing_accuracy
from captioner.models.preprocess import Preprocess

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/, at the repo root
from tools import judge  # noqa: E402


def read_log(path: str, ids_by_name: dict[str, int]) -> dict[int, tuple[list[str], np.ndarray]]:
    """Image id → (words, attention (n, g, g)) from a `captioner caption --jsonl` log."""
    out = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            out[ids_by_name[os.path.basename(r["file_name"])]] = (r["words"], np.asarray(r["attention"], np.float32))
    return out


def reach(
    words: list[str], attention: np.ndarray, anns: list[dict], shapes: dict[int, str], size, pre, both: bool
) -> bool:
    """Whether every object the caption names is one of the scene's and its shape word's map (with `both`,
    its colour word's map too) peaks on it."""
    left, top, right, bottom = pre.grid_box(*size)
    things = [(a["color"], shapes[a["category_id"]], a["bbox"]) for a in anns]
    colours, names = {t[0] for t in things} | judge.KNOWN_COLOURS, {t[1] for t in things} | judge.KNOWN_SHAPES
    for k in range(len(words) - 1):
        if not (words[k] in colours and words[k + 1] in names):
            continue
        boxes = [b for c, s, b in things if (c, s) == (words[k], words[k + 1])]
        for j in (k, k + 1) if both else (k + 1,):
            fx, fy = peak(attention[j])
            px, py = left + fx * (right - left), top + fy * (bottom - top)
            if not any(x <= px <= x + w and y <= py <= y + h for x, y, w, h in boxes):
                return False
    return True


def figures(log: str, boxes_path: str) -> dict:
    """The three figures (and their counts) of a caption log against the scenes' boxes."""
    boxes = GroundingBoxes(boxes_path)
    coco = boxes.coco
    ids_by_name = {im["file_name"]: int(im["id"]) for im in coco.dataset["images"]}
    captions = read_log(log, ids_by_name)
    objects = judge.read_objects(boxes_path)
    shapes = {c["id"]: c["name"] for c in coco.dataset["categories"]}
    right = judge.accuracy({i: w for i, (w, _) in captions.items()}, objects)
    pre, reached, reached_both = Preprocess(), [], []
    for i, (words, attention) in captions.items():
        colours = {c for c, _ in objects[i]} | judge.KNOWN_COLOURS
        names = {s for _, s in objects[i]} | judge.KNOWN_SHAPES
        if len(judge.named_objects(words, colours, names)) >= 2:
            anns = coco.imgToAnns.get(i, [])
            reached.append(reach(words, attention, anns, shapes, boxes.size(i), pre, both=False))
            reached_both.append(reach(words, attention, anns, shapes, boxes.size(i), pre, both=True))
    point = pointing_accuracy(captions, boxes, pre)
    return {
        "scenes": len(captions),
        "named_exactly_right": right,
        "pointing": point["pointing"],
        "pointing_words": point["words"],
        "two_object_reach": float(np.mean(reached)) if reached else None,
        "two_object_reach_both_words": float(np.mean(reached_both)) if reached_both else None,
        "two_object_captions": len(reached),
        "two_objects_package_measure": point["two_objects"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("log", help="the --jsonl log of `captioner caption --attention`")
    p.add_argument("boxes", help="COCO instances file of the scenes, with a 'color' per box")
    args = p.parse_args()
    print(json.dumps(figures(args.log, args.boxes), indent=1))


if __name__ == "__main__":
    main()
