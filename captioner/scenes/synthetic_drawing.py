"""Drawing the synthetic scenes: the colours and shapes, backgrounds, object layout, image files.

An object is a dict (`Obj`): its colour and shape names, its square box (x0, y0, side) in pixels and
the area its mask covers. The random draws happen in a fixed order, which `synthetic.generate` keeps.
"""

from __future__ import annotations

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


def render(rng: np.random.Generator, w: int, h: int) -> tuple[Image.Image, list[Obj], str]:
    bg_arr, bg = _background(rng, w, h)
    img = Image.fromarray(bg_arr, "RGB")
    objs = _place_objects(rng, w, h, int(rng.choice([1, 2, 3], p=[0.25, 0.40, 0.35])))
    for o in objs:
        x0, y0, side = o["box"]
        mask = _shape_mask(o["shape"], side)
        img.paste(COLORS[o["color"]], (x0, y0, x0 + side, y0 + side), mask)
        o["area"] = int(np.count_nonzero(np.asarray(mask)))
    return img, objs, bg


def save_image(img: Image.Image, path: Path, mode: str, fmt: str) -> None:
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
