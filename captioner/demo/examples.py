"""The bundled examples: test scenes drawn at random (seeded, never chosen by hand), copied beside the
demo model, and each judged by the caption the saved model writes for it, as the page shows it."""

from __future__ import annotations

import os
import shutil

import numpy as np

from captioner.data.dataset import CaptionData
from captioner.scenes import judge as scenes
from captioner.serve.api import Captioner

EXAMPLE_BEAM = 3  # the page's default beam size: the card shows what a visitor will see


def judge_examples(checkpoint: str, paths: dict[int, str], objects: dict[int, list]) -> list[dict]:
    """Caption example images with a saved model, as the page does, and judge each caption."""
    outs = Captioner.load(checkpoint).caption_batch([paths[i] for i in paths], beam_size=EXAMPLE_BEAM)
    return [
        {"file": os.path.basename(paths[i]), "caption": out.text, **scenes.judge(out.words, objects[i])}
        for i, out in zip(paths, outs)
    ]


def pick_examples(image_ids, objects: dict[int, list], k: int, seed: int) -> list[int]:
    """k test image ids drawn at random (seeded), as many with one, two and three objects as there can be."""
    rng = np.random.default_rng(seed)
    counts = sorted({len(objects[int(i)]) for i in image_ids})
    picked = []
    for j, count in enumerate(counts):
        pool = [int(i) for i in image_ids if len(objects[int(i)]) == count]
        share = (k - len(picked)) // (len(counts) - j)
        picked += [int(i) for i in rng.choice(pool, size=min(share, len(pool)), replace=False)]
    return picked


def copy_examples(data: CaptionData, objects, k: int, seed: int, examples_dir: str) -> dict[int, str]:
    """k test scenes drawn at random (seeded), copied into examples_dir: image id → path."""
    shutil.rmtree(examples_dir, ignore_errors=True)
    os.makedirs(examples_dir)
    ids, rows = data.split_images("test")
    row_of = dict(zip(ids.tolist(), rows.tolist()))
    paths = {}
    for image_id in pick_examples(ids, objects, k, seed):
        path = data.path_of(int(row_of[image_id]))
        paths[image_id] = os.path.join(examples_dir, os.path.basename(path))
        shutil.copy(path, paths[image_id])
    return paths
