"""Drawing the held-out scenes: shapes rasterised from implicit functions, backgrounds, layout.

Written apart from `synthetic_drawing`, with which it shares no code. An object is a dict with its
colour and shape names, its square box (x, y, side) in pixels and the area its coverage sums to.
"""

from __future__ import annotations

import numpy as np

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
