"""Synthetic "coloured shapes" captioning dataset in MS-COCO format.

Each image shows 1-3 non-overlapping coloured shapes on a plain, noisy or gradient background, with
five captions ("a red circle to the left of a blue square", ...) whose spatial words are derived
from the object boxes, so captions are always true of the image.

Running ``python -m captioner.scenes.synthetic OUT --n N --seed S`` writes::

    OUT/images/         N images (mostly RGB JPEG; some RGB/RGBA/P PNG, CMYK JPEG)
    OUT/captions.json   COCO captions file, like captions_train2014.json
    OUT/splits.json     Karpathy dataset_coco.json layout (train/restval/val/test)
    OUT/boxes.json      COCO instances file (a category per shape, bbox in pixels, a "color" field)

Deterministic for a given (N, seed): a smoke test for the whole pipeline and the demo model's data.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from captioner.scenes.synthetic_drawing import SHAPES, Obj, render, save_image
from captioner.scenes.synthetic_wording import captions

# (image mode, file format, probability): mostly RGB JPEG, like real COCO.
_MODES: tuple[tuple[str, str, float], ...] = (
    ("RGB", "JPEG", 0.65),
    ("RGB", "PNG", 0.12),
    ("RGBA", "PNG", 0.09),
    ("P", "PNG", 0.09),
    ("CMYK", "JPEG", 0.05),
)
_MIN_SIDE, _MAX_SIDE = 96, 320


def _write_json(path: Path, obj: Any) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(obj, f, separators=(",", ":"))
        os.chmod(tmp, 0o644)  # mkstemp makes 0600 files; outputs are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _splits(rng: np.random.Generator, n: int) -> list[str]:
    n_val = max(1, int(0.1 * n + 0.5)) if n >= 2 else 0
    n_test = max(1, int(0.1 * n + 0.5)) if n >= 3 else 0
    n_restval = int(0.1 * (n - n_val - n_test) + 0.5)
    labels = ["val"] * n_val + ["test"] * n_test + ["restval"] * n_restval
    labels += ["train"] * (n - len(labels))
    return [labels[i] for i in rng.permutation(n)]


def _draw_scene(rng: np.random.Generator, out: Path, img_id: int, mode_index: int) -> tuple[dict, list[Obj], list[str]]:
    """One image drawn and saved: its COCO image entry, its objects and its five captions."""
    w = int(rng.integers(_MIN_SIDE, _MAX_SIDE + 1))
    h = int(rng.integers(max(_MIN_SIDE, w // 2), min(_MAX_SIDE, 2 * w) + 1))
    img, objs, bg = render(rng, w, h)
    mode, fmt = _MODES[mode_index][:2]
    fname = f"COCO_synth_{img_id:012d}.{'jpg' if fmt == 'JPEG' else 'png'}"
    save_image(img, out / "images" / fname, mode, fmt)
    image = {"id": img_id, "file_name": fname, "width": w, "height": h}
    return image, objs, captions(rng, objs, bg, w, h)


def _box_annotations(img_id: int, objs: list[Obj], first_id: int) -> list[dict]:
    """COCO instances annotations of one image's objects, numbered from first_id."""
    return [
        {
            "id": first_id + k,
            "image_id": img_id,
            "category_id": SHAPES.index(o["shape"]) + 1,
            "bbox": [o["box"][0], o["box"][1], o["box"][2], o["box"][2]],
            "area": o["area"],
            "iscrowd": 0,
            "color": o["color"],
        }
        for k, o in enumerate(objs)
    ]


def _write_files(out: Path, seed: int, images: list, caps_anns: list, box_anns: list, karpathy: list) -> None:
    info = {
        "description": "captioner synthetic coloured shapes",
        "version": "1.1",
        "year": 2024,
        "contributor": "captioner.synthetic",
        "seed": seed,
    }
    _write_json(out / "captions.json", {"info": info, "licenses": [], "images": images, "annotations": caps_anns})
    _write_json(out / "splits.json", {"dataset": "coco", "images": karpathy})
    cats = [{"id": i + 1, "name": s, "supercategory": "shape"} for i, s in enumerate(SHAPES)]
    boxes = {"info": info, "licenses": [], "images": images, "categories": cats, "annotations": box_anns}
    _write_json(out / "boxes.json", boxes)


def generate(out_dir: str | os.PathLike[str], n: int, seed: int = 0) -> dict[str, Any]:
    """Write n images plus captions/splits/boxes JSON into out_dir; return counts."""
    if n <= 0:
        raise ValueError(f"n must be positive, got {n}")
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    # Random, sorted, non-contiguous ids so code cannot assume id == index.
    img_ids = np.sort(rng.choice(999_999, size=n, replace=False) + 1).tolist()
    ann_ids = np.sort(rng.choice(9_999_999, size=5 * n, replace=False) + 1).tolist()
    modes = rng.choice(len(_MODES), size=n, p=[m[2] for m in _MODES])
    split_of = _splits(rng, n)
    images, caps_anns, box_anns, karpathy = [], [], [], []
    for idx, (img_id, m) in enumerate(zip(img_ids, modes)):
        image, objs, caps = _draw_scene(rng, out, img_id, m)
        images.append(image)
        box_anns += _box_annotations(img_id, objs, len(box_anns) + 1)
        sents = []
        for cap in caps:
            sid = len(caps_anns)
            caps_anns.append({"id": ann_ids[sid], "image_id": img_id, "caption": cap})
            sents.append({"tokens": re.findall(r"[a-z]+", cap.lower()), "raw": cap, "imgid": idx, "sentid": sid})
        karpathy.append(
            {
                "filepath": "images",
                "filename": image["file_name"],
                "imgid": idx,
                "cocoid": img_id,
                "split": split_of[idx],
                "sentids": [s["sentid"] for s in sents],
                "sentences": sents,
            }
        )
    _write_files(out, seed, images, caps_anns, box_anns, karpathy)
    return {
        "out_dir": str(out),
        "images": n,
        "captions": len(caps_anns),
        "objects": len(box_anns),
        "splits": {s: split_of.count(s) for s in ("train", "restval", "val", "test")},
    }


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m captioner.scenes.synthetic",
        description="Write a synthetic coloured-shapes captioning dataset in COCO format.",
    )
    parser.add_argument("out", help="output directory (created if missing)")
    parser.add_argument("--n", type=_positive_int, default=100, help="number of images (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    args = parser.parse_args(argv)
    summary = generate(args.out, args.n, args.seed)
    print(
        f"wrote {summary['images']} images, {summary['captions']} captions, "
        f"{summary['objects']} boxes to {summary['out_dir']} (splits: {summary['splits']})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
