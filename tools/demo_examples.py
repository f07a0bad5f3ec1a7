"""The bundled examples: the first scenes of a seed fixed before any model was scored (never chosen
by hand, never a training or test scene), copied beside the demo model, and each judged by the
caption the saved model writes for it, as the page shows it.

The card records what the saved model wrote for each example (`demo.card.example_outputs`: words, score
and every word's map), so that a change to the code that moves a saved model's outputs is seen
(tests/test_saved_outputs.py). `python -m tools.demo_examples`, run from the repo root, records them
again for the bundled model and judges them anew, keeping the rest of its card.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

from captioner.demo.card import example_outputs
from captioner.io import read_json, write_json_atomic
from captioner.scenes.synthetic import generate
from captioner.serve.api import Captioner
from captioner.serve.sources import DEMO_MODEL, example_images
from tools import judge as scenes

EXAMPLES_SEED = 20261127  # the examples' scenes: a seed fixed before the model was scored, used for nothing else


def judge_examples(checkpoint: str, paths: dict[int, str], objects: dict[int, list]) -> list[dict]:
    """Caption example images with a saved model, as the page does, and judge each caption."""
    outs = example_outputs(Captioner.load(checkpoint), [paths[i] for i in paths])
    return [{**out, **scenes.judge(out["caption"].split(), objects[i])} for i, out in zip(paths, outs)]


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


def record_outputs(model_dir: str = DEMO_MODEL) -> list[dict]:
    """Caption the bundled examples with an exported model as the page does today, judge each caption against
    the objects drawn in it, and record both in the model's card; returns the card's examples."""
    config_path = os.path.join(model_dir, "config.json")
    config = read_json(config_path, "exported model config")
    bundled = {os.path.basename(path): path for path in example_images()}
    with tempfile.TemporaryDirectory() as tmp:
        drawn, objects = draw_examples(len(bundled), os.path.join(tmp, "examples"))
    paths = {i: bundled[os.path.basename(path)] for i, path in drawn.items()}
    config["card"]["examples"] = judge_examples(model_dir, paths, objects)
    write_json_atomic(config_path, config)
    return config["card"]["examples"]


if __name__ == "__main__":
    for example in record_outputs():
        judged = "right" if example["correct"] else "wrong"
        print(f"{example['file']}: {example['caption']} ({example['score']:.4f}, {judged})")
