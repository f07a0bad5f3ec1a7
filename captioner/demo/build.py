"""Build a demo model like the bundled one: `python -m captioner.demo.build [--n 8000 --minutes 35]`.

Generates synthetic scenes, prepares them with the seeded random VGG16 (no download needed), and
trains a soft-attention decoder on the frozen features at the package's defaults. With
`--tune-minutes M` a second stage continues from its best weights, training the decoder together
with the encoder's conv5 layers (`fit --init ... --fine-tune-encoder`) at lower learning rates.
The bundled model was made in two stages by the code of commit 51524e6 (its card says how); at
today's defaults the second stage lowered the captions, so it is off unless asked for
(docs/results.md, "The bundled demo model"). The build scores the result on the held-out test
scenes and writes `captioner/assets/demo/` (an exported folder: weights and any trained encoder
layers in fp16, no optimizer state, with a model card) and a few test scenes as example images.
The examples are drawn at random from the test split (seeded), never chosen by hand, and the
card records, for each, the caption the saved model writes and whether it names the scene's
objects right (`captioner.scenes.judge`), with the share of all test scenes it gets right, so
the page can show how often the model is right beside them.
Everything is seeded; the training budgets are in minutes, so the result depends on the
machine's speed (the card records the steps each stage reached). With `--work DIR`, stages
already finished there (scenes, features, a training stage that ran to its end) are reused,
and a stage that did not finish is trained again.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Annotated

import numpy as np
import torch

from captioner.data.dataset import CaptionData
from captioner.evaluation.evaluate import evaluate, results_path
from captioner.models.checkpoint import load_checkpoint, save_checkpoint
from captioner.models.decoder import DecoderConfig
from captioner.models.encoder import EncoderSpec
from captioner.options import add_options, from_args
from captioner.scenes import judge as scenes
from captioner.scenes.synthetic import generate
from captioner.serve.api import Captioner
from captioner.serve.export import export
from captioner.serve.sources import DEMO_MODEL, EXAMPLES_DIR
from captioner.train.finetune import FineTuneConfig
from captioner.train.loop import TrainConfig, fit
from captioner.train.prepare import PrepareConfig, prepare

EXAMPLE_BEAM = 3  # the page's default beam size: the card shows what a visitor will see
# The second stage, when asked for (measured in docs/results.md): the decoder at a fifth of its
# first learning rate, conv5 at a tenth of fine-tuning's default.
TUNE_MINUTES = 0.0
TUNE_LR = 2e-4
TUNE_ENCODER_LR = 1e-5


def pick_examples(image_ids, k: int, seed: int) -> list[int]:
    """k image ids drawn at random (seeded) from a split, in the order drawn."""
    ids = np.asarray(image_ids)
    return [int(i) for i in np.random.default_rng(seed).choice(ids, size=min(k, len(ids)), replace=False)]


def judge_examples(checkpoint: str, paths: dict[int, str], objects: dict[int, list]) -> list[dict]:
    """Caption example images with a saved checkpoint, as the page does, and judge each caption."""
    cap = Captioner.load(checkpoint)
    outs = cap.caption_batch([paths[i] for i in paths], beam_size=EXAMPLE_BEAM)
    return [
        {"file": os.path.basename(paths[i]), "caption": out.text, **scenes.judge(out.words, objects[i])}
        for i, out in zip(paths, outs)
    ]


def _events(run: str) -> list[dict]:
    """The records of a run's metrics.jsonl."""
    with open(os.path.join(run, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def finished(run: str) -> bool:
    """Whether a run directory holds a training that ended on its own (not stopped or crashed)."""
    if not all(os.path.exists(os.path.join(run, f)) for f in ("best.pt", "metrics.jsonl")):
        return False
    events = [e.get("event") for e in _events(run)]
    last_start = len(events) - 1 - events[::-1].index("start") if "start" in events else 0
    return bool(events) and events[-1] == "end" and "stopped" not in events[last_start:]


def train_stage(data: str, run: str, decoder: DecoderConfig | None, cfg: TrainConfig) -> str:
    """Train one stage into `run` unless it already finished there; returns its best.pt."""
    if not finished(run):
        shutil.rmtree(run, ignore_errors=True)
        fit(data, run, decoder, cfg)
    return os.path.join(run, "best.pt")


def stage_steps(work: str, tune_minutes: float) -> dict:
    """Steps each training stage ran, and the step its best.pt is from."""
    out = {}
    for name, stage in (("frozen encoder", "run"), ("conv5 fine-tuned", "tuned"))[: 2 if tune_minutes else 1]:
        ck = load_checkpoint(os.path.join(work, stage, "best.pt"))
        end = [e for e in _events(os.path.join(work, stage)) if e.get("event") == "end"][-1]
        out[name] = {"steps": int(end["step"]), "best_step": int(ck["step"])}
    return out


def build(
    work: str,
    *,
    n: int,
    seed: int,
    minutes: float,
    tune_minutes: float = TUNE_MINUTES,
    examples: int = 6,
    model_dir: str = DEMO_MODEL,
    examples_dir: str = EXAMPLES_DIR,
    decoder: DecoderConfig | None = None,
) -> dict:
    """Make the demo model (an exported folder) and its examples; returns the model card.

    Args:
        work: where the scenes, features, training runs and the packed checkpoint go.
        minutes: the first stage's budget (frozen encoder); tune_minutes: the second's (0: none).
        model_dir, examples_dir: where the model and the example images are written.
        decoder: decoder sizes (default: the package's defaults, dropout 0.5).
    """
    src, data = os.path.join(work, "scenes"), os.path.join(work, "data")
    if not os.path.exists(os.path.join(src, "boxes.json")):  # written last
        generate(src, n, seed=seed)
    prepare(
        PrepareConfig(
            captions=[os.path.join(src, "captions.json")],
            images=[os.path.join(src, "images")],
            out=data,
            splits=os.path.join(src, "splits.json"),
            encoder=EncoderSpec(weights="none"),
        )
    )
    best = _train(work, data, seed, minutes, tune_minutes, decoder)
    boxes = os.path.join(src, "boxes.json")
    metrics_path = os.path.join(os.path.dirname(best), "test_metrics.json")
    metrics = evaluate(best, data, "test", metrics_path, grounding=boxes)
    # Exactly right or not, scene by scene: the metrics above cannot tell a circle from a square.
    objects = scenes.read_objects(boxes)
    with open(results_path(metrics_path), encoding="utf-8") as f:
        test_words = {r["image_id"]: r["caption"].split() for r in json.load(f)}
    ck = _packed(load_checkpoint(best))
    ck["card"] = {
        "trained_on": f"{n} synthetic scenes of coloured shapes (python -m captioner.scenes.synthetic OUT --n {n} "
        f"--seed {seed}), features from the seeded random VGG16 (--encoder-weights none)"
        + (", its conv5 layers then trained on the scenes with the decoder" if tune_minutes else ""),
        "limits": "knows coloured shapes only; real photos need a COCO-trained model (docs/training.md)",
        "rebuild": f"python -m captioner.demo.build --n {n} --seed {seed} --minutes {minutes:g} "
        f"--tune-minutes {tune_minutes:g}",
        "stages": stage_steps(work, tune_minutes),
        "test_metrics": {
            k: metrics[k] for k in ("BLEU-1", "BLEU-4", "METEOR", "ROUGE-L", "CIDEr", "pointing", "two_objects")
        },
        "test_images": metrics["images"],
        "attention_health": metrics["attention_health"],
        "scene_accuracy": scenes.accuracy(test_words, objects),
    }
    packed = os.path.join(work, "demo.pt")
    save_checkpoint(ck, packed)
    export(packed, model_dir)
    paths = _copy_examples(CaptionData(data), examples, seed, examples_dir)
    # Judged with the exported fp16 model on the copied files: what the page shows for each example.
    ck["card"]["examples"] = judge_examples(model_dir, paths, objects)
    save_checkpoint(ck, packed)
    export(packed, model_dir)
    return ck["card"]


def _train(work: str, data: str, seed: int, minutes: float, tune_minutes: float, decoder) -> str:
    """The two stages; returns the best.pt of the last."""
    best = train_stage(
        data,
        os.path.join(work, "run"),
        decoder or DecoderConfig(0, dropout=0.5),
        TrainConfig.of(epochs=1000, max_minutes=minutes, patience=1000, seed=seed),
    )
    if not tune_minutes:
        return best
    return train_stage(
        data,
        os.path.join(work, "tuned"),
        None,
        TrainConfig.of(
            epochs=1000,
            max_minutes=tune_minutes,
            patience=1000,
            seed=seed,
            lr=TUNE_LR,
            init=best,
            fine_tune=FineTuneConfig(lr=TUNE_ENCODER_LR),
        ),
    )


def _packed(ck: dict) -> dict:
    """The checkpoint without its training state, weights and trained encoder layers in fp16."""
    keep = {k: v for k, v in ck.items() if k not in ("format", "optimizer", "scheduler", "rng", "training_model")}
    keep["model"] = _half(ck["model"])
    if "encoder_state" in ck:
        keep["encoder_state"] = _half(ck["encoder_state"])  # loaded into the fp32 encoder as floats
    return keep


def _half(state: dict) -> dict:
    return {k: v.half() if v.is_floating_point() else v for k, v in state.items()}


def _copy_examples(data: CaptionData, k: int, seed: int, examples_dir: str) -> dict[int, str]:
    """k test scenes drawn at random (seeded), copied into examples_dir: image id → path."""
    shutil.rmtree(examples_dir, ignore_errors=True)
    os.makedirs(examples_dir)
    ids, rows = data.split_images("test")
    row_of = dict(zip(ids.tolist(), rows.tolist()))
    paths = {}
    for image_id in pick_examples(ids, k, seed):
        path = data.path_of(int(row_of[image_id]))
        paths[image_id] = os.path.join(examples_dir, os.path.basename(path))
        shutil.copy(path, paths[image_id])
    return paths


@dataclass
class BuildOptions:
    """`python -m captioner.demo.build`'s options."""

    n: Annotated[int, "synthetic scenes to generate"] = 8000
    seed: Annotated[int, "seed of the scenes, the training and the examples drawn"] = 0
    minutes: Annotated[float, "first stage's training budget (frozen encoder)"] = 35.0
    tune_minutes: Annotated[
        float, "second stage's budget: decoder and conv5 from the first's best weights (0: skip it)"
    ] = TUNE_MINUTES
    examples: Annotated[int, "example scenes drawn at random from the test split"] = 6
    work: Annotated[str | None, "keep the scenes, features and runs here (default: a temporary directory)"] = None


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_options(p, BuildOptions)
    opts = from_args(BuildOptions, p.parse_args(argv))
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    with tempfile.TemporaryDirectory() as tmp:
        card = build(
            opts.work or tmp,
            n=opts.n,
            seed=opts.seed,
            minutes=opts.minutes,
            tune_minutes=opts.tune_minutes,
            examples=opts.examples,
        )
    print(f"wrote {DEMO_MODEL} and {EXAMPLES_DIR}")
    right = sum(e["correct"] for e in card["examples"])
    print(f"examples right: {right} of {len(card['examples'])}; test scenes right: {card['scene_accuracy']:.1%}")
    print(card)


if __name__ == "__main__":
    main()
