"""A second scene generator, written independently of `captioner.synthetic`, for held-out checks.

Defaults chosen on one generator did not carry over to scenes made elsewhere (soft attention
that pointed 0.69 on `synthetic`'s scenes pointed 0.18 on someone else's). This module shares
no drawing, layout or wording code with `synthetic`: shapes are rasterised here from implicit
functions with NumPy (supersampled for anti-aliasing), on flat, gradient, noisy, cluttered or
striped backgrounds; images are small to large and often far from square; files are RGB, RGBA
(partly transparent backgrounds) or grayscale; objects take 15-35% of the short side and may
touch the image's edges; the captions use their own wording.

``python -m captioner.scenes.heldout OUT --n N --seed S`` writes the same layout as `synthetic`::

    OUT/images/         N images (JPEG and PNG; RGB, RGBA and grayscale)
    OUT/captions.json   COCO captions file
    OUT/splits.json     Karpathy layout (train/val/test)
    OUT/boxes.json      COCO instances: one category per shape, a "color" field per object
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (205, 30, 35),
    "green": (30, 150, 45),
    "blue": (35, 70, 200),
    "yellow": (235, 205, 25),
    "orange": (240, 120, 15),
    "purple": (120, 45, 160),
    "pink": (240, 120, 185),
    "white": (250, 250, 250),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "cross", "ring", "hexagon")
_SUPERSAMPLE = 3  # sub-pixel samples per side, for anti-aliased edges


# drawing


def _inside(shape: str, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Whether points (u, v) in the shape's box, scaled to [-1, 1]², are inside the shape."""
    r = np.hypot(u, v)
    if shape == "circle":
        return r <= 1.0
    if shape == "ring":
        return (r <= 1.0) & (r >= 0.55)
    if shape == "square":
        return (np.abs(u) <= 0.9) & (np.abs(v) <= 0.9)
    if shape == "cross":
        return ((np.abs(u) <= 0.3) & (np.abs(v) <= 1.0)) | ((np.abs(v) <= 0.3) & (np.abs(u) <= 1.0))
    if shape == "triangle":  # apex up, base along the bottom
        return (v <= 1.0) & (v >= 2.0 * np.abs(u) - 1.0)
    if shape == "hexagon":  # flat top and bottom
        return (np.abs(v) <= 0.866) & (0.866 * np.abs(u) + 0.5 * np.abs(v) <= 0.866)
    raise ValueError(f"unknown shape {shape!r}")


def _coverage(shape: str, side: int) -> np.ndarray:
    """(side, side) share of each pixel the shape covers, in [0, 1]."""
    n = side * _SUPERSAMPLE
    t = (np.arange(n) + 0.5) / n * 2.0 - 1.0  # sample centres in [-1, 1]
    v, u = np.meshgrid(t, t, indexing="ij")
    inside = _inside(shape, u, v).astype(np.float32)  # (n, n)
    return inside.reshape(side, _SUPERSAMPLE, side, _SUPERSAMPLE).mean(axis=(1, 3))


def _background(rng: np.random.Generator, w: int, h: int) -> tuple[np.ndarray, str, str]:
    """(h, w, 3) float background, its kind, and a word for its brightness."""
    level = float(rng.uniform(25, 225))
    tint = rng.normal(0, 6, size=3)  # a faint colour cast
    base = np.full((h, w, 3), level) + tint
    kind = str(rng.choice(["flat", "gradient", "noisy", "cluttered", "striped"], p=[0.2, 0.2, 0.2, 0.3, 0.1]))
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    if kind == "gradient":
        angle = rng.uniform(0, 2 * np.pi)
        ramp = np.cos(angle) * xx / w + np.sin(angle) * yy / h
        base += (ramp - ramp.mean())[..., None] * rng.uniform(30, 90)
    elif kind == "noisy":
        base += rng.normal(0, rng.uniform(6, 18), size=(h, w, 1)) + rng.normal(0, 3, size=(h, w, 3))
    elif kind == "striped":
        period = rng.uniform(6, 24)
        angle = rng.uniform(0, np.pi)
        phase = (np.cos(angle) * xx + np.sin(angle) * yy) / period
        base += (np.sin(2 * np.pi * phase) * rng.uniform(6, 14))[..., None]
    elif kind == "cluttered":
        # Faint marks of low contrast and little colour: lines, dots and blotches no caption names.
        for _ in range(int(rng.integers(8, 40))):
            shade = level + rng.uniform(-30, 30) + rng.normal(0, 8, size=3)
            x, y = rng.uniform(0, w), rng.uniform(0, h)
            size = rng.uniform(0.01, 0.06) * min(w, h) + 1
            if rng.random() < 0.5:
                mark = (np.abs(xx - x) < size) & (np.abs(yy - y) < size * rng.uniform(0.2, 1))
            else:
                angle = rng.uniform(0, np.pi)
                dist = np.abs(-np.sin(angle) * (xx - x) + np.cos(angle) * (yy - y))
                along = np.abs(np.cos(angle) * (xx - x) + np.sin(angle) * (yy - y))
                mark = (dist < 0.8) & (along < size * 4)
            base[mark] = shade
    word = "dark" if level < 85 else "light" if level > 170 else "grey"
    return base, kind, word


def _luma(rgb) -> float:
    r, g, b = rgb
    return 0.299 * r + 0.587 * g + 0.114 * b


def _layout(rng: np.random.Generator, w: int, h: int, count: int, level: float) -> list[dict]:
    """Up to `count` objects: distinct (colour, shape) pairs in non-overlapping boxes."""
    short = min(w, h)
    objects: list[dict] = []
    for _ in range(100 * count):
        if len(objects) == count:
            break
        side = max(8, int(round(rng.uniform(0.15, 0.35) * short)))
        x, y = int(rng.integers(0, w - side + 1)), int(rng.integers(0, h - side + 1))
        if any(
            x < o["x"] + o["side"] and o["x"] < x + side and y < o["y"] + o["side"] and o["y"] < y + side
            for o in objects
        ):
            continue
        color = str(rng.choice(list(PALETTE)))
        if abs(_luma(PALETTE[color]) - level) < 40:  # keep every object visible
            continue
        shape = str(rng.choice(SHAPES))
        if any(o["color"] == color and o["shape"] == shape for o in objects):
            continue
        objects.append({"color": color, "shape": shape, "x": x, "y": y, "side": side})
    return objects


def render(rng: np.random.Generator, w: int, h: int) -> tuple[np.ndarray, list[dict], str, str]:
    """One scene: (h, w, 3) uint8 pixels, its objects, the background kind and its word."""
    pixels, kind, bg_word = _background(rng, w, h)
    count = int(rng.choice([1, 2, 3], p=[0.35, 0.45, 0.2]))
    objects = _layout(rng, w, h, count, float(pixels.mean()))
    for o in objects:
        x, y, s = o["x"], o["y"], o["side"]
        cover = _coverage(o["shape"], s)[..., None]  # (s, s, 1)
        colour = np.asarray(PALETTE[o["color"]], dtype=np.float32) + rng.normal(0, 8, size=3)
        shading = 1.0 + rng.uniform(-0.12, 0.12) * np.linspace(-1, 1, s)[:, None, None]  # light from above or below
        patch = pixels[y : y + s, x : x + s]
        pixels[y : y + s, x : x + s] = patch * (1 - cover) + colour * shading * cover
        o["area"] = float(cover.sum())
    return np.clip(pixels, 0, 255).round().astype(np.uint8), objects, kind, bg_word


# wording


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _noun(o: dict, colour: bool) -> str:
    words = f"{o['color']} {o['shape']}" if colour else o["shape"]
    return f"{_article(words)} {words}"


def _where(o: dict, w: int, h: int) -> str:
    cx, cy = (o["x"] + o["side"] / 2) / w, (o["y"] + o["side"] / 2) / h
    col = "left" if cx < 1 / 3 else "right" if cx > 2 / 3 else ""
    row = "upper" if cy < 1 / 3 else "lower" if cy > 2 / 3 else ""
    if not col and not row:
        return "at the centre"
    if col and row:
        return f"in the {row} {col} corner"
    return f"in the {row or 'middle'} part" if row else f"on the {col} side"


def _beside(a: dict, b: dict) -> str:
    """How a stands to b, from their centres, on the axis where they differ most."""
    dx = (a["x"] + a["side"] / 2) - (b["x"] + b["side"] / 2)
    dy = (a["y"] + a["side"] / 2) - (b["y"] + b["side"] / 2)
    if abs(dx) >= abs(dy):
        return "to the left of" if dx < 0 else "to the right of"
    return "over" if dy < 0 else "under"


def captions_for(
    rng: np.random.Generator, objects: list[dict], bg_word: str, w: int, h: int, colour: bool
) -> list[str]:
    """Five captions in this generator's own wording; no colour words for grayscale files."""
    out = []
    for _ in range(5):
        objs = [objects[i] for i in rng.permutation(len(objects))]
        nouns = [_noun(o, colour) for o in objs]
        if len(objs) == 1:
            (o,), (n,) = objs, nouns
            options = [
                n,
                f"{n} {_where(o, w, h)}",
                f"a picture of {n}",
                f"one {n.split(' ', 1)[1]} on a {bg_word} background",
                f"{n} is shown {_where(o, w, h)}",
                f"just {n} and nothing else",
            ]
        elif len(objs) == 2:
            (a, b), rel = nouns, _beside(objs[0], objs[1])
            options = [
                f"{a} and {b}",
                f"{a} {rel} {b}",
                f"two shapes, {a} and {b}",
                f"{a} placed {rel} {b}",
                f"a picture with {a} and {b}",
            ]
        else:
            a, b, c = nouns
            options = [
                f"{a}, {b} and {c}",
                f"three shapes: {a}, {b} and {c}",
                f"{a} {_beside(objs[0], objs[1])} {b}, and {c}",
                f"a {bg_word} scene with {a}, {b} and {c}",
            ]
        text = options[int(rng.integers(len(options)))]
        if rng.random() < 0.4:
            text = text.capitalize()
        out.append(text + ("." if rng.random() < 0.3 else ""))
    return out


# files


def _size(rng: np.random.Generator) -> tuple[int, int]:
    """Small, medium or large; up to 2.5:1 either way."""
    short = int(rng.choice([rng.integers(48, 112), rng.integers(128, 400), rng.integers(400, 720)], p=[0.2, 0.6, 0.2]))
    ratio = float(np.exp(rng.uniform(-np.log(2.5), np.log(2.5))))
    return (int(short * ratio), short) if ratio >= 1 else (short, int(short / ratio))


def _save(pixels: np.ndarray, path: Path, kind: str, rng: np.random.Generator) -> None:
    if kind == "gray":
        Image.fromarray(pixels).convert("L").save(path)
    elif kind == "rgba":
        # Opaque shapes over a background that is partly see-through (viewers show white behind it).
        alpha = np.full(pixels.shape[:2], 255, dtype=np.uint8)
        alpha[:] = int(rng.integers(140, 256))
        img = Image.fromarray(np.dstack([pixels, alpha]), "RGBA")
        img.save(path)
    else:
        options = {"quality": int(rng.integers(70, 96))} if path.suffix == ".jpg" else {}
        Image.fromarray(pixels).save(path, **options)


def _write(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def generate(out_dir: str | os.PathLike[str], n: int, seed: int = 0) -> dict[str, Any]:
    """Write n scenes with captions, a Karpathy split and object boxes into out_dir."""
    if n < 1:
        raise ValueError(f"n must be positive, got {n}")
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng([seed, 20261122])
    ids = rng.choice(np.arange(10_000, 90_000_000), size=n, replace=False).tolist()  # unordered, large
    images, captions, boxes, karpathy = [], [], [], []
    for idx, image_id in enumerate(ids):
        w, h = _size(rng)
        pixels, objects, _, bg_word = render(rng, w, h)
        kind = str(rng.choice(["rgb", "gray", "rgba"], p=[0.7, 0.15, 0.15]))
        name = f"scene-{image_id}.{'png' if kind != 'rgb' or rng.random() < 0.2 else 'jpg'}"
        _save(pixels, out / "images" / name, kind, rng)
        images.append({"id": image_id, "file_name": name, "width": w, "height": h})
        for o in objects:
            boxes.append(
                {
                    "id": len(boxes) + 1,
                    "image_id": image_id,
                    "category_id": SHAPES.index(o["shape"]) + 1,
                    "bbox": [o["x"], o["y"], o["side"], o["side"]],
                    "area": o["area"],
                    "iscrowd": 0,
                    "color": o["color"],
                }
            )
        texts = captions_for(rng, objects, bg_word, w, h, colour=kind != "gray")
        sentences = []
        for text in texts:
            captions.append({"id": int(rng.integers(1, 2**31 - 1)), "image_id": image_id, "caption": text})
            sentences.append({"raw": text, "tokens": text.lower().replace(",", " ").replace(".", " ").split()})
        fraction = idx / n
        split = "test" if fraction < 0.1 else "val" if fraction < 0.2 else "train"
        karpathy.append(
            {
                "filepath": "images",
                "filename": name,
                "cocoid": image_id,
                "imgid": idx,
                "split": split,
                "sentences": sentences,
            }
        )
    info = {"description": "captioner.heldout scenes", "seed": seed}
    _write(out / "captions.json", {"info": info, "images": images, "annotations": captions})
    _write(out / "splits.json", {"dataset": "coco", "images": karpathy})
    categories = [{"id": i + 1, "name": s, "supercategory": "shape"} for i, s in enumerate(SHAPES)]
    _write(out / "boxes.json", {"info": info, "images": images, "categories": categories, "annotations": boxes})
    return {"out_dir": str(out), "images": n, "captions": len(captions), "objects": len(boxes)}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m captioner.scenes.heldout", description="Write independent held-out scenes in COCO format."
    )
    p.add_argument("out", help="output directory")
    p.add_argument("--n", type=int, default=500, help="number of images (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    args = p.parse_args(argv)
    if args.n < 1:
        p.error(f"--n must be positive, got {args.n}")
    s = generate(args.out, args.n, args.seed)
    print(f"wrote {s['images']} images, {s['captions']} captions, {s['objects']} boxes to {s['out_dir']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
