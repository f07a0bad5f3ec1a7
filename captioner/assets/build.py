"""Rebuild the bundled demo model: `python -m captioner.assets.build [--minutes 20]`.

Generates synthetic scenes, prepares them with the seeded random VGG16 (no download needed),
trains a soft-attention decoder, scores it on the held-out test scenes, and writes
`captioner/assets/demo.pt` (weights in fp16, no optimizer state, with a model card) and a few
test scenes as example images. Everything is seeded; the training budget is in minutes, so
the result depends on the machine's speed (the card records the steps it reached).
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile

import torch

from ..checkpoint import load_checkpoint, save_checkpoint
from ..data import CaptionData
from ..decoder import DecoderConfig
from ..encoder import EncoderSpec
from ..evaluation import evaluate
from ..prepare import prepare
from ..synthetic import generate
from ..training import TrainConfig, fit
from . import DEMO_CHECKPOINT, EXAMPLES_DIR


def build(work: str, *, n: int, seed: int, minutes: float, examples: int = 6) -> dict:
    src, data, run = (os.path.join(work, d) for d in ("scenes", "data", "run"))
    generate(src, n, seed=seed)
    prepare([os.path.join(src, "captions.json")], [os.path.join(src, "images")], data,
            splits=os.path.join(src, "splits.json"), encoder=EncoderSpec(weights="none", seed=0))
    fit(data, run, DecoderConfig(0, dropout=0.5), TrainConfig(epochs=1000, max_minutes=minutes, patience=1000, seed=seed))
    metrics = evaluate(os.path.join(run, "best.pt"), data, "test", os.path.join(run, "test_metrics.json"),
                       grounding=os.path.join(src, "boxes.json"))
    ck = load_checkpoint(os.path.join(run, "best.pt"))
    keep = {k: v for k, v in ck.items() if k not in ("format", "optimizer", "scheduler", "rng")}
    keep["model"] = {k: v.half() if v.is_floating_point() else v for k, v in ck["model"].items()}
    keep["card"] = {
        "trained_on": f"{n} synthetic scenes of coloured shapes (python -m captioner.synthetic OUT --n {n} "
                      f"--seed {seed}), features from the seeded random VGG16 (--encoder-weights none)",
        "limits": "knows coloured shapes only; real photos need a COCO-trained checkpoint "
                  "(README.md, section 'Train on MS-COCO')",
        "rebuild": f"python -m captioner.assets.build --n {n} --seed {seed} --minutes {minutes:g}",
        "test_metrics": {k: metrics[k] for k in ("BLEU-1", "BLEU-4", "METEOR", "ROUGE-L", "CIDEr", "pointing")},
        "test_images": metrics["images"],
    }
    save_checkpoint(keep, DEMO_CHECKPOINT)
    shutil.rmtree(EXAMPLES_DIR, ignore_errors=True)
    os.makedirs(EXAMPLES_DIR)
    scenes = CaptionData(data)
    _, rows = scenes.split_images("test")
    for row in rows[:examples]:
        path = scenes.path_of(int(row))
        shutil.copy(path, os.path.join(EXAMPLES_DIR, os.path.basename(path)))
    return keep["card"]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--n", type=int, default=2000, help="synthetic scenes to generate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--minutes", type=float, default=20.0, help="training budget")
    p.add_argument("--work", help="keep the scenes, features and run here (default: a temporary directory)")
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    if args.work:
        card = build(args.work, n=args.n, seed=args.seed, minutes=args.minutes)
    else:
        with tempfile.TemporaryDirectory() as work:
            card = build(work, n=args.n, seed=args.seed, minutes=args.minutes)
    print(f"wrote {DEMO_CHECKPOINT} ({os.path.getsize(DEMO_CHECKPOINT) / 1e6:.1f} MB) and {EXAMPLES_DIR}")
    print(card)


if __name__ == "__main__":
    main()
