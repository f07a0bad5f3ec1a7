"""A second scene generator, written independently of `captioner.synthetic`, for held-out checks.

Defaults chosen on one generator did not carry over to scenes made elsewhere (soft attention
that pointed 0.69 on `synthetic`'s scenes pointed 0.18 on someone else's). This module shares
no drawing, layout or wording code with `synthetic`: shapes are rasterised here from implicit
functions with NumPy (supersampled for anti-aliasing), on flat, gradient, noisy, cluttered or
striped backgrounds; images are small to large and often far from square; files are RGB, RGBA
(partly transparent backgrounds) or grayscale; objects take 15-35% of the short side and may
touch the image's edges; the captions use their own wording. The drawing is in `heldout_drawing`,
the wording in `heldout_wording`; this module writes the files (through `tools.scene_files`).

``python -m tools.heldout OUT --n N --seed S`` writes the same layout as `synthetic`::

    OUT/images/         N images (JPEG and PNG; RGB, RGBA and grayscale)
    OUT/captions.json   COCO captions file
    OUT/splits.json     Karpathy layout (train/val/test)
    OUT/boxes.json      COCO instances: one category per shape, a "color" field per object
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from tools import scene_files
from tools.heldout_drawing import SHAPES, render
from tools.heldout_wording import captions_for
from tools.scene_files import instance, split_entry, write_set


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
            bbox = [o["x"], o["y"], o["side"], o["side"]]
            instance(boxes, image_id, SHAPES.index(o["shape"]) + 1, bbox, o["area"], o["color"])
        texts = captions_for(rng, objects, bg_word, w, h, colour=kind != "gray")
        for text in texts:
            captions.append({"id": int(rng.integers(1, 2**31 - 1)), "image_id": image_id, "caption": text})
        fraction = idx / n
        split = "test" if fraction < 0.1 else "val" if fraction < 0.2 else "train"
        karpathy.append(split_entry(name, image_id, idx, split, texts))
    info = {"description": "captioner.heldout scenes", "seed": seed}
    return write_set(out, info, SHAPES, images, captions, karpathy, boxes)


def main(argv: Sequence[str] | None = None) -> int:
    description = "Write independent held-out scenes in COCO format."
    return scene_files.main(generate, argv, prog="python -m tools.heldout", description=description, n=500)


if __name__ == "__main__":
    raise SystemExit(main())
