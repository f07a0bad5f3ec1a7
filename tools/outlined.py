"""Outlined shapes on textured backgrounds: a third scene generator, for checking defaults honestly.

Settings tuned on one generator's scenes can point well there and worse elsewhere, so their pointing is
measured also on scenes made apart from the tuning. This module shares no drawing, layout or wording code with
`captioner.scenes.synthetic` or `tools.heldout` (it writes its files, as `tools.heldout` does, through
`tools.scene_files`). It draws circles, squares, triangles, pentagons, arrows and hearts, rotated, about two
in three as thick hollow outlines and the rest filled with a darker rim, one to three to a scene, often
touching a border; on wooden, checked, mottled, shaded or grainy backgrounds; in RGB images 160 to 640 px a
side, from 1:2.5 to 2.5:1. Each image has five captions in its own wording, naming every object's colour and
shape and, with two or more, how they stand to each other.

``python -m tools.outlined OUT --n N --seed S`` writes the layout the project reads::

    OUT/images/         N images (JPEG and PNG)
    OUT/captions.json   COCO captions file
    OUT/splits.json     Karpathy layout (train/val/test)
    OUT/boxes.json      COCO instances: one category per shape, a "color" field per object (written
                        last: its presence marks a complete set)
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

from tools import scene_files
from tools.scene_files import instance, split_entry, write_set

PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (215, 35, 40),
    "green": (40, 160, 60),
    "blue": (40, 80, 215),
    "yellow": (240, 215, 40),
    "orange": (245, 130, 20),
    "purple": (130, 50, 170),
    "black": (20, 20, 20),
    "white": (245, 245, 245),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "pentagon", "arrow", "heart")
BACKGROUNDS: tuple[str, ...] = ("wooden", "checked", "mottled", "shaded", "grainy")
_SS = 3  # supersampling per side, for smooth outlines


# drawing


def _outline(shape: str) -> np.ndarray:
    """(P, 2) points (x, y) of the shape's boundary, about unit radius, y down."""
    if shape == "heart":
        t = np.linspace(0, 2 * np.pi, 64, endpoint=False)
        x, y = 16 * np.sin(t) ** 3, 13 * np.cos(t) - 5 * np.cos(2 * t) - 2 * np.cos(3 * t) - np.cos(4 * t)
        return np.stack([x, -y - 6], axis=1) / 16
    if shape == "arrow":
        return np.array([[-1, -0.28], [0.15, -0.28], [0.15, -0.7], [1, 0], [0.15, 0.7], [0.15, 0.28], [-1, 0.28]])
    sides = {"circle": 72, "square": 4, "triangle": 3, "pentagon": 5}[shape]
    t = -np.pi / 2 + np.pi / 4 * (sides == 4) + 2 * np.pi * np.arange(sides) / sides
    return np.stack([np.cos(t), np.sin(t)], axis=1)


def _mask(points: np.ndarray, size: tuple[int, int], width: int, filled: bool) -> tuple[Image.Image, Image.Image]:
    """The fill and rim coverage masks (mode L, `size`) of a polygon drawn at _SS times, then reduced."""
    big = (size[0] * _SS, size[1] * _SS)
    xy = [tuple(p) for p in (points * _SS).tolist()]
    fill, rim = Image.new("L", big), Image.new("L", big)
    if filled:
        ImageDraw.Draw(fill).polygon(xy, fill=255)
    ImageDraw.Draw(rim).line(xy + xy[:2], fill=255, width=width * _SS, joint="curve")
    return fill.resize(size, Image.BOX), rim.resize(size, Image.BOX)


def _noise(rng: np.random.Generator, w: int, h: int, cell: float) -> np.ndarray:
    """(h, w) smooth value noise in about [-1, 1], varying over `cell` pixels."""
    grid = rng.uniform(-1, 1, size=(max(2, int(h / cell) + 2), max(2, int(w / cell) + 2))).astype(np.float32)
    return np.asarray(Image.fromarray(grid).resize((w, h), Image.BICUBIC))


def _background(rng: np.random.Generator, w: int, h: int) -> tuple[np.ndarray, str]:
    """(h, w, 3) float pixels of a textured background, and the word for its kind."""
    kind = str(rng.choice(BACKGROUNDS))
    base = rng.uniform(60, 200) + rng.normal(0, 12, size=3)  # muted: colour words stay the objects'
    other = base + rng.uniform(-60, 60) + rng.normal(0, 12, size=3)  # lighter or darker, tinted a little
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    angle = rng.uniform(0, np.pi)
    along = np.cos(angle) * xx + np.sin(angle) * yy  # (h, w) distance along a random direction
    if kind == "wooden":  # warped growth rings with grain
        base = base * np.array([1.15, 0.9, 0.65])
        rings = np.sin(
            2 * np.pi * (along / rng.uniform(8, 30) + rng.uniform(0.3, 0.8) * _noise(rng, w, h, rng.uniform(60, 160)))
        )
        t = (0.5 + 0.5 * rings) ** 2 + 0.15 * _noise(rng, w, h, 3)
        mix = t[..., None] * rng.uniform(0.25, 0.45)
        pixels = base * (1 - mix)
    elif kind == "checked":
        cell = rng.uniform(8, 48)
        across = -np.sin(angle) * xx + np.cos(angle) * yy
        odd = ((np.floor(along / cell) + np.floor(across / cell)) % 2)[..., None]
        pixels = base * (1 - odd) + other * odd + rng.normal(0, 4, size=(h, w, 1))
    elif kind == "mottled":  # fractal noise mixes two tints
        t = sum(_noise(rng, w, h, c) / k for k, c in enumerate((64, 24, 8), start=1))
        pixels = base + (other - base) * np.clip(0.5 + 0.5 * t, 0, 1)[..., None]
    elif kind == "shaded":  # a lit, photo-like gradient with sensor grain
        ramp = (along - along.min()) / max(1.0, float(along.max() - along.min()))
        cx, cy = rng.uniform(0, w), rng.uniform(0, h)
        light = 1.2 - 0.5 * np.hypot(xx - cx, yy - cy) / np.hypot(w, h)
        pixels = (base + (other - base) * ramp[..., None]) * light[..., None] + rng.normal(0, 5, size=(h, w, 3))
    else:  # grainy: blurred noise, coarse and fine
        grain = Image.fromarray(rng.integers(0, 256, size=(h, w), dtype=np.uint8))
        blurred = np.asarray(grain.filter(ImageFilter.GaussianBlur(rng.uniform(0.8, 2.5))), dtype=np.float32)
        t = (blurred - blurred.mean()) / (blurred.std() + 1e-6) * rng.uniform(15, 30) + 20 * _noise(rng, w, h, 40)
        pixels = base + t[..., None]
    return np.clip(pixels, 0, 255).astype(np.float32), kind


def _size(rng: np.random.Generator) -> tuple[int, int]:
    """(w, h): 160 to 640 px a side, from 1:2.5 to 2.5:1."""
    ratio = float(np.exp(rng.uniform(0, np.log(2.5))))
    long = int(rng.integers(max(160, int(160 * ratio)), 641))
    short = max(160, round(long / ratio))
    return (long, short) if rng.random() < 0.5 else (short, long)


def _place(rng: np.random.Generator, extent: tuple[int, int], image: tuple[int, int]) -> tuple[int, int]:
    """Top-left corner of an object's canvas: half of them against a border, or within a few pixels."""
    (cw, ch), (w, h) = extent, image
    x, y = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
    if rng.random() < 0.5:
        gap = int(rng.integers(0, 4))
        edge = int(rng.integers(4))
        x = gap if edge == 0 else w - cw - gap if edge == 1 else x
        y = gap if edge == 2 else h - ch - gap if edge == 3 else y
    return max(0, x), max(0, y)


def _apart(a: tuple[int, ...], b: tuple[int, ...], gap: int = 4) -> bool:
    """Whether boxes (x0, y0, x1, y1) leave at least `gap` pixels between them."""
    return a[2] + gap <= b[0] or b[2] + gap <= a[0] or a[3] + gap <= b[1] or b[3] + gap <= a[1]


def draw_scene(rng: np.random.Generator, w: int, h: int) -> tuple[Image.Image, list[dict], str]:
    """An image, its objects (shape, color, filled, tight box [x, y, w, h], area) and its background word."""
    pixels, kind = _background(rng, w, h)
    img = Image.fromarray(pixels.astype(np.uint8))
    mean = pixels.reshape(-1, 3).mean(axis=0)
    taken: list[tuple[int, int, int, int]] = []
    objects: list[dict] = []
    for _ in range(int(rng.choice([1, 2, 3], p=[0.35, 0.35, 0.3]))):
        # Colours that stand out from the background; no two objects alike in both colour and shape.
        colours = [c for c, rgb in PALETTE.items() if np.linalg.norm(np.array(rgb) - mean) > 90]
        color, shape = str(rng.choice(colours)), str(rng.choice(SHAPES))
        if any(o["color"] == color and o["shape"] == shape for o in objects):
            continue
        radius = rng.uniform(0.1, 0.23) * min(w, h)
        width = max(3, int(rng.uniform(0.08, 0.16) * 2 * radius))
        turn = rng.uniform(-0.5, 0.5) if shape in ("heart", "triangle") else rng.uniform(0, 2 * np.pi)
        rot = np.array([[np.cos(turn), -np.sin(turn)], [np.sin(turn), np.cos(turn)]])
        points = _outline(shape) @ rot.T * radius  # (P, 2)
        lo = points.min(axis=0) - width / 2 - 1
        extent = tuple(int(v) for v in np.ceil(points.max(axis=0) + width / 2 + 1 - lo))
        for _ in range(50):
            x, y = _place(rng, extent, (w, h))
            box = (x, y, x + extent[0], y + extent[1])
            if all(_apart(box, other) for other in taken):
                break
        else:
            continue
        filled = bool(rng.random() < 1 / 3)
        fill, rim = _mask(points - lo, extent, width, filled)
        rgb = np.clip(np.array(PALETTE[color]) + rng.integers(-12, 13, size=3), 0, 255)
        img.paste(tuple(int(v) for v in rgb), box, fill)
        img.paste(tuple(int(v) for v in rgb * (0.6 if filled else 1.0)), box, rim)
        cover = np.maximum(np.asarray(fill), np.asarray(rim))
        left, top, right, bottom = Image.fromarray(cover).getbbox()
        taken.append(box)
        objects.append(
            {
                "shape": shape,
                "color": color,
                "filled": filled,
                "bbox": [x + left, y + top, right - left, bottom - top],
                "area": float(cover.sum() / 255),
            }
        )
    return img, objects, kind


# wording


def _noun(rng: np.random.Generator, o: dict) -> str:
    """'a red heart', sometimes saying how it is drawn: 'an outlined red heart', 'a solid red heart'."""
    look = ""
    if rng.random() < 0.4:
        look = str(rng.choice(["solid", "filled"] if o["filled"] else ["outlined", "hollow"])) + " "
    words = f"{look}{o['color']} {o['shape']}"
    return ("an " if words[0] in "aeiou" else "a ") + words


def _where(o: dict, w: int, h: int) -> str:
    """Where an object lies: against which border or in which corner, else in which part."""
    x, y, bw, bh = o["bbox"]
    near = 0.06 * min(w, h)
    side = "left" if x <= near else "right" if x + bw >= w - near else ""
    end = "top" if y <= near else "bottom" if y + bh >= h - near else ""
    if side and end:
        return f"in the {end} {side} corner"
    if side or end:
        return f"against the {side or end} edge"
    cx, cy = (x + bw / 2) / w, (y + bh / 2) / h
    part = "top" if cy < 0.35 else "bottom" if cy > 0.65 else "left" if cx < 0.35 else "right" if cx > 0.65 else ""
    return f"near the {part}" if part else "in the middle"


def _relation(a: dict, b: dict) -> str:
    """How a stands to b, along the axis on which their centres differ more."""
    (ax, ay, aw, ah), (bx, by, bw, bh) = a["bbox"], b["bbox"]
    dx, dy = (ax + aw / 2) - (bx + bw / 2), (ay + ah / 2) - (by + bh / 2)
    if abs(dx) > abs(dy):
        return "to the left of" if dx < 0 else "to the right of"
    return "above" if dy < 0 else "below"


def _caption(rng: np.random.Generator, objects: list[dict], bg: str, size: tuple[int, int]) -> str:
    """One caption naming every object's colour and shape, in a random order and template."""
    objs = [objects[i] for i in rng.permutation(len(objects))]
    n = [_noun(rng, o) for o in objs]
    at = [_where(o, *size) for o in objs]
    if len(objs) == 1:
        options = [n[0], f"{n[0]} on a {bg} background", f"{n[0]} {at[0]}", f"there is {n[0]} {at[0]}"]
        options += [] if objs[0]["filled"] else [f"the outline of a {objs[0]['color']} {objs[0]['shape']}"]
    elif len(objs) == 2:
        rel = _relation(*objs)
        options = [f"{n[0]} {rel} {n[1]}", f"{n[0]} and {n[1]} on a {bg} background"]
        options += [f"two shapes, {n[0]} and {n[1]}", f"{n[0]} {at[0]} and {n[1]} {at[1]}"]
        options.append(f"{n[1]} with {n[0]} {rel} it")
    else:
        options = [f"{n[0]}, {n[1]} and {n[2]}", f"three shapes on a {bg} background, {n[0]}, {n[1]} and {n[2]}"]
        options += [f"{n[0]} {_relation(objs[0], objs[1])} {n[1]}, and {n[2]} {at[2]}"]
        options.append(f"a {bg} scene with {n[0]}, {n[1]} and {n[2]}")
    text = str(rng.choice(options))
    text = text[0].upper() + text[1:] if rng.random() < 0.5 else text
    return text + ("." if rng.random() < 0.3 else "")


def captions(rng: np.random.Generator, objects: list[dict], bg: str, size: tuple[int, int]) -> list[str]:
    """Five different captions, as COCO has five per image (every scene has a dozen or more to draw from)."""
    texts: dict[str, str] = {}
    while len(texts) < 5:
        text = _caption(rng, objects, bg, size)
        texts.setdefault(text.lower().rstrip("."), text)
    return list(texts.values())


def generate(out_dir: str | os.PathLike[str], n: int = 1200, seed: int = 0, scale: float = 1.0) -> dict[str, Any]:
    """Write n scenes, their captions, a Karpathy split and object boxes into out_dir. `scale` shrinks
    every image (tests use it to stay quick); the sets measured keep 1."""
    if n < 1:
        raise ValueError(f"n must be positive, got {n}")
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng([seed, 7_150_321])
    ids = (rng.choice(80_000_000, size=n, replace=False) + 10_000).tolist()  # not an index
    held = max(1, round(0.1 * n))
    split_of = dict(zip(rng.permutation(n).tolist(), ["test"] * held + ["val"] * held + ["train"] * n))
    images, anns, boxes, karpathy = [], [], [], []
    for idx, image_id in enumerate(ids):
        w, h = (max(32, round(v * scale)) for v in _size(rng))
        img, objects, bg = draw_scene(rng, w, h)
        name = f"{image_id:08d}." + ("png" if rng.random() < 0.25 else "jpg")
        img.save(out / "images" / name, **({"quality": int(rng.integers(80, 96))} if name.endswith("jpg") else {}))
        images.append({"id": image_id, "file_name": name, "width": w, "height": h})
        for o in objects:
            instance(boxes, image_id, SHAPES.index(o["shape"]) + 1, o["bbox"], o["area"], o["color"])
        texts = captions(rng, objects, bg, (w, h))
        for text in texts:
            anns.append({"id": len(anns) + 1, "image_id": image_id, "caption": text})
        karpathy.append(split_entry(name, image_id, idx, split_of[idx], texts))
    info = {"description": "tools.outlined scenes", "seed": seed}
    return write_set(out, info, SHAPES, images, anns, karpathy, boxes)


def main(argv: Sequence[str] | None = None) -> int:
    description = "Write outlined-shape scenes, COCO format."
    return scene_files.main(generate, argv, prog="python -m tools.outlined", description=description, n=1200)


if __name__ == "__main__":
    raise SystemExit(main())
