"""The bundled examples: the first scenes of a seed fixed before any model was scored (never chosen
by hand, never a training or test scene), copied beside the demo model, and each judged by the
caption the saved model writes for it, as the page shows it."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

from captioner.demo.options import PAGE_BEAM
from captioner.scenes import judge as scenes
from captioner.scenes.synthetic import generate
from captioner.serve.api import Captioner

EXAMPLES_SEED = 20261127  # the examples' scenes: a seed fixed before the model was scored, used for nothing else


def judge_examples(checkpoint: str, paths: dict[int, str], objects: dict[int, list]) -> list[dict]:
    """Caption example images with a saved model, as the page does, and judge each caption."""
    outs = Captioner.load(checkpoint).caption_batch([paths[i] for i in paths], beam_size=PAGE_BEAM)
    return [
        {"file": os.path.basename(paths[i]), "caption": out.text, **scenes.judge(out.words, objects[i])}
        for i, out in zip(paths, outs)
    ]


def draw_examples(k: int, examples_dir: str) -> tuple[dict[int, str], dict[int, list]]:
    """The first k scenes of `EXAMPLES_SEED`, drawn anew and copied into examples_dir: image id → path,
    and image id → the objects drawn in it."""
    shutil.rmtree(examples_dir, ignore_errors=True)
    os.makedirs(examples_dir)
    with tempfile.TemporaryDirectory() as tmp:
        generate(tmp, k, seed=EXAMPLES_SEED)
        with open(os.path.join(tmp, "captions.json"), encoding="utf-8") as f:
            files = {int(im["id"]): im["file_name"] for im in json.load(f)["images"]}
        paths = {i: shutil.copy(os.path.join(tmp, "images", name), examples_dir) for i, name in sorted(files.items())}
        return paths, scenes.read_objects(os.path.join(tmp, "boxes.json"))
