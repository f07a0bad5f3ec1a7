"""Synthetic "coloured shapes" captioning dataset in MS-COCO format.

Each image shows 1-3 non-overlapping coloured shapes (circle, square, triangle,
diamond, star) on a plain, slightly noisy or gradient background. Every image
gets five captions built from a small vocabulary ("a red circle to the left of
a blue square", "A single green star near the top." ...); spatial words are
derived from the object boxes, so captions are always true of the image.

Running ``python -m captioner.scenes.synthetic OUT --n N --seed S`` writes::

    OUT/images/         N images (mostly RGB JPEG; some RGB/RGBA/P PNG, CMYK JPEG)
    OUT/captions.json   COCO captions file, like captions_train2014.json
    OUT/splits.json     Karpathy dataset_coco.json layout (train/restval/val/test)
    OUT/boxes.json      COCO instances file (one category per shape, bbox in
                        pixels, plus a "color" field) for attention-grounding checks

The dataset is tiny and fully deterministic for a given (N, seed), which makes
it a smoke test for the whole pipeline and a training set for a demo model.
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
from PIL import Image, ImageDraw

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 225),
    "yellow": (240, 220, 40),
    "purple": (150, 60, 190),
    "orange": (245, 140, 30),
    "white": (245, 245, 245),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "diamond", "star")

# Background brightness bands (name, min level, max level). All are near-gray,
# so they never get confused with the saturated object colours or with white.
_BACKGROUNDS: tuple[tuple[str, int, int], ...] = (("black", 15, 45), ("gray", 95, 140), ("light gray", 170, 195))
# (image mode, file format, probability): mostly RGB JPEG, like real COCO.
_MODES: tuple[tuple[str, str, float], ...] = (
    ("RGB", "JPEG", 0.65),
    ("RGB", "PNG", 0.12),
    ("RGBA", "PNG", 0.09),
    ("P", "PNG", 0.09),
    ("CMYK", "JPEG", 0.05),
)
_MIN_SIDE, _MAX_SIDE = 96, 320
_LONG_REL = {"left": "to the left of", "right": "to the right of", "above": "above", "below": "below"}
_SHORT_REL = {"left": "left of", "right": "right of", "above": "above", "below": "below"}
# Caption templates: {a} {b} {c} are noun phrases ("a red circle"), {rel}/{srel}
# the long/short relation of a to b, {pos} where a single object sits.
_TEMPLATES: dict[int, tuple[str, ...]] = {
    1: (
        "{a}",
        "a single {bare} {pos}",
        "there is {a} {pos}",
        "{a} on a {bg} background",
        "{a} {pos} of the image",
        "a {bg} background with {a}",
        "the image shows {a}",
    ),
    2: (
        "{a} {rel} {b}",
        "{a} is {srel} {b}",
        "the image shows {a} {rel} {b}",
        "there is {a} next to {b}",
        "{a} and {b}",
        "{a} and {b} on a {bg} background",
    ),
}
# Three-object scenes are described whole: every template names all three objects, so a model
# is never taught to leave one out. Nine of them, as many as the pool they replace (six pair and
# three triple templates up to version 1.0), so the random stream, and every image, is unchanged.
_TRIPLE_TEMPLATES = (
    "{a}, {b} and {c}",
    "{a}, {b} and {c} on a {bg} background",
    "there is {a}, {b} and {c}",
    "the image shows {a}, {b} and {c}",
    "{a} {rel} {b}, and {c}",
    "{a} is {srel} {b}, and there is {c}",
    "{a} next to {b} and {c}",
    "{a} and {b} with {c}",
    "a {bg} background with {a}, {b} and {c}",
)

Obj = dict[str, Any]  # {"color", "shape", "box": (x0, y0, side), "area"}


def _unit_polygon(shape: str) -> list[tuple[float, float]]:
    """Polygon vertices of a shape, normalised to fill the unit square."""
    if shape == "triangle":
        return [(0.5, 0.0), (1.0, 1.0), (0.0, 1.0)]
    if shape == "diamond":
        return [(0.5, 0.0), (1.0, 0.5), (0.5, 1.0), (0.0, 0.5)]
    if shape == "star":
        ang = -np.pi / 2 + np.arange(10) * np.pi / 5
        rad = np.where(np.arange(10) % 2 == 0, 1.0, 0.45)
        xs, ys = rad * np.cos(ang), rad * np.sin(ang)
        # Stretch so the star touches all four sides of its box (tight bbox).
        xs = (xs - xs.min()) / (xs.max() - xs.min())
        ys = (ys - ys.min()) / (ys.max() - ys.min())
        return list(zip(xs.tolist(), ys.tolist()))
    raise ValueError(f"not a polygon shape: {shape}")


def _shape_mask(shape: str, side: int) -> Image.Image:
    """Binary 'L' mask of a shape filling a side x side box."""
    mask = Image.new("L", (side, side), 0)
    draw = ImageDraw.Draw(mask)
    last = side - 1
    if shape == "circle":
        draw.ellipse([0, 0, last, last], fill=255)
    elif shape == "square":
        draw.rectangle([0, 0, last, last], fill=255)
    else:
        draw.polygon([(u * last, v * last) for u, v in _unit_polygon(shape)], fill=255)
    return mask


def _background(rng: np.random.Generator, w: int, h: int) -> tuple[np.ndarray, str]:
    name, lo, hi = _BACKGROUNDS[rng.integers(len(_BACKGROUNDS))]
    base = rng.integers(lo, hi + 1) + rng.integers(-10, 11, size=3)
    if rng.random() < 0.5:
        noise = rng.normal(0.0, rng.uniform(2.0, 6.0), size=(h, w, 3))
    else:
        # Soft linear gradient in a random direction, at most +-12 levels.
        theta = rng.uniform(0, 2 * np.pi)
        yy, xx = np.mgrid[0:h, 0:w]
        ramp = np.cos(theta) * xx / w + np.sin(theta) * yy / h
        noise = (ramp - ramp.mean())[..., None] * rng.uniform(8.0, 24.0)
    return np.clip(base + noise, 0, 255).astype(np.uint8), name


def _place_objects(rng: np.random.Generator, w: int, h: int, k: int) -> list[Obj]:
    """Rejection-sample up to k square boxes that keep a gap between them."""
    short = min(w, h)
    margin, gap = max(3, short // 25), max(4, short // 16)
    lo, hi = int(0.20 * short), int(0.45 * short)
    objs: list[Obj] = []
    for _ in range(60 * k):
        if len(objs) == k:
            break
        side = int(rng.integers(lo, hi + 1))
        x0 = int(rng.integers(margin, w - margin - side + 1))
        y0 = int(rng.integers(margin, h - margin - side + 1))
        if any(
            x0 < ox + os_ + gap and ox < x0 + side + gap and y0 < oy + os_ + gap and oy < y0 + side + gap
            for ox, oy, os_ in (o["box"] for o in objs)
        ):
            continue
        color = str(rng.choice(list(COLORS)))
        shape = str(rng.choice(SHAPES))
        if any(o["color"] == color and o["shape"] == shape for o in objs):
            continue
        objs.append({"color": color, "shape": shape, "box": (x0, y0, side)})
    return objs


def _centre(o: Obj) -> tuple[float, float]:
    x0, y0, s = o["box"]
    return x0 + s / 2, y0 + s / 2


def _relation(a: Obj, b: Obj) -> str:
    """Where a is relative to b, on the axis with the larger centre difference."""
    (ax, ay), (bx, by) = _centre(a), _centre(b)
    if abs(ax - bx) >= abs(ay - by):
        return "left" if ax < bx else "right"
    return "above" if ay < by else "below"


def _position(o: Obj, w: int, h: int) -> str:
    cx, cy = _centre(o)
    dx, dy = cx / w - 0.5, cy / h - 0.5
    if max(abs(dx), abs(dy)) < 0.12:
        return "in the middle"
    if abs(dx) >= abs(dy):
        return "on the left" if dx < 0 else "on the right"
    return "near the top" if dy < 0 else "near the bottom"


def _phrase(o: Obj) -> str:
    """Noun phrase with article: 'a red circle', 'an orange star'."""
    article = "an" if o["color"][0] in "aeiou" else "a"
    return f"{article} {o['color']} {o['shape']}"


def _captions(rng: np.random.Generator, objs: list[Obj], bg: str, w: int, h: int) -> list[str]:
    """Five captions from distinct templates, with varied case and full stop."""
    pool = _TRIPLE_TEMPLATES if len(objs) == 3 else _TEMPLATES[len(objs)]
    caps = []
    for t in rng.choice(len(pool), size=5, replace=False):
        # A fresh object order per caption: the objects are named, and related, in a random order.
        order = [objs[i] for i in rng.permutation(len(objs))]
        rel = _relation(order[0], order[1]) if len(order) > 1 else "left"
        a, b, c = ([_phrase(o) for o in order] + ["", ""])[:3]
        cap = pool[t].format(
            a=a,
            b=b,
            c=c,
            bare=f"{order[0]['color']} {order[0]['shape']}",
            rel=_LONG_REL[rel],
            srel=_SHORT_REL[rel],
            pos=_position(order[0], w, h),
            bg=bg,
        )
        if rng.random() < 0.5:
            cap = cap[0].upper() + cap[1:]
        if rng.random() < 0.5:
            cap += "."
        caps.append(cap)
    return caps


def _render(rng: np.random.Generator, w: int, h: int) -> tuple[Image.Image, list[Obj], str]:
    bg_arr, bg = _background(rng, w, h)
    img = Image.fromarray(bg_arr, "RGB")
    objs = _place_objects(rng, w, h, int(rng.choice([1, 2, 3], p=[0.25, 0.40, 0.35])))
    for o in objs:
        x0, y0, side = o["box"]
        mask = _shape_mask(o["shape"], side)
        img.paste(COLORS[o["color"]], (x0, y0, x0 + side, y0 + side), mask)
        o["area"] = int(np.count_nonzero(np.asarray(mask)))
    return img, objs, bg


def _save(img: Image.Image, path: Path, mode: str, fmt: str) -> None:
    if mode == "P":
        # A plain adaptive palette can merge a small object into background
        # shades, so the object colours are pinned as exact palette entries.
        shades = img.quantize(colors=56, dither=Image.Dither.NONE).getpalette()[: 56 * 3]
        pal = Image.new("P", (1, 1))
        pal.putpalette([v for rgb in COLORS.values() for v in rgb] + shades)
        img = img.quantize(palette=pal, dither=Image.Dither.NONE)
    elif mode != "RGB":
        img = img.convert(mode)  # RGBA gets opaque alpha; CMYK stays colourful
    img.save(path, fmt, **({"quality": 90} if fmt == "JPEG" else {}))


def _write_json(path: Path, obj: Any) -> None:
    """Write JSON atomically so readers never see a half-written file."""
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
        w = int(rng.integers(_MIN_SIDE, _MAX_SIDE + 1))
        h = int(rng.integers(max(_MIN_SIDE, w // 2), min(_MAX_SIDE, 2 * w) + 1))
        img, objs, bg = _render(rng, w, h)
        mode, fmt = _MODES[m][:2]
        fname = f"COCO_synth_{img_id:012d}.{'jpg' if fmt == 'JPEG' else 'png'}"
        _save(img, out / "images" / fname, mode, fmt)
        images.append({"id": img_id, "file_name": fname, "width": w, "height": h})
        for o in objs:
            x0, y0, side = o["box"]
            box_anns.append(
                {
                    "id": len(box_anns) + 1,
                    "image_id": img_id,
                    "category_id": SHAPES.index(o["shape"]) + 1,
                    "bbox": [x0, y0, side, side],
                    "area": o["area"],
                    "iscrowd": 0,
                    "color": o["color"],
                }
            )
        sents = []
        for cap in _captions(rng, objs, bg, w, h):
            sid = len(caps_anns)
            caps_anns.append({"id": ann_ids[sid], "image_id": img_id, "caption": cap})
            sents.append({"tokens": re.findall(r"[a-z]+", cap.lower()), "raw": cap, "imgid": idx, "sentid": sid})
        karpathy.append(
            {
                "filepath": "images",
                "filename": fname,
                "imgid": idx,
                "cocoid": img_id,
                "split": split_of[idx],
                "sentids": [s["sentid"] for s in sents],
                "sentences": sents,
            }
        )
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
    _write_json(
        out / "boxes.json",
        {"info": info, "licenses": [], "images": images, "categories": cats, "annotations": box_anns},
    )
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
