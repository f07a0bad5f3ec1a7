"""The files a scene generator of tools/ writes, in the layout the project reads (that of
`captioner.scenes.synthetic`), and its command line. The generators share these and nothing of their
drawing, layout or wording::

    OUT/images/         the images
    OUT/captions.json   COCO captions file
    OUT/splits.json     Karpathy layout (train/val/test)
    OUT/boxes.json      COCO instances: one category per shape, a "color" field per object (written
                        last: its presence marks a complete set)
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def _write(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj), encoding="utf-8")
    os.replace(tmp, path)


def instance(boxes: list[dict], image_id: int, category_id: int, bbox: list, area: float, color: str) -> None:
    """Append one object's COCO instance to `boxes`."""
    record = {"id": len(boxes) + 1, "image_id": image_id, "category_id": category_id, "bbox": bbox}
    boxes.append({**record, "area": area, "iscrowd": 0, "color": color})


def split_entry(name: str, image_id: int, idx: int, split: str, texts: Sequence[str]) -> dict:
    """An image's entry of the Karpathy split file, its captions tokenised."""
    sentences = [{"raw": t, "tokens": t.lower().replace(",", " ").replace(".", " ").split()} for t in texts]
    entry = {"filepath": "images", "filename": name, "cocoid": image_id, "imgid": idx, "split": split}
    return {**entry, "sentences": sentences}


def write_set(out: Path, info: dict, shapes: Sequence[str], images: list, captions: list, karpathy: list, boxes: list):
    """The three files beside OUT/images/, boxes.json last; returns what was written."""
    _write(out / "captions.json", {"info": info, "images": images, "annotations": captions})
    _write(out / "splits.json", {"dataset": "coco", "images": karpathy})
    categories = [{"id": i + 1, "name": s, "supercategory": "shape"} for i, s in enumerate(shapes)]
    _write(out / "boxes.json", {"info": info, "images": images, "categories": categories, "annotations": boxes})
    return {"out_dir": str(out), "images": len(images), "captions": len(captions), "objects": len(boxes)}


def main(generate: Callable[..., dict], argv: Sequence[str] | None, *, prog: str, description: str, n: int) -> int:
    """`python -m PROG OUT --n N --seed S`: `generate(OUT, N, S)`, and a line saying what it wrote."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("out", help="output directory")
    p.add_argument("--n", type=int, default=n, help="number of images (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    args = p.parse_args(argv)
    if args.n < 1:
        p.error(f"--n must be positive, got {args.n}")
    s = generate(args.out, args.n, args.seed)
    print(f"wrote {s['images']} images, {s['captions']} captions, {s['objects']} boxes to {s['out_dir']}")
    return 0
