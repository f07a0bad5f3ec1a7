"""Build the bundled demo model: `python -m tools.build_demo [--n 8000 --epochs 20 --device auto]`.

Generates synthetic scenes; pretrains VGG16's conv5 block on the training scenes' boxes, as VGG is
pretrained on ImageNet for photos (`tools.pretrain_encoder`: conv1-4 the seeded random ones, no download
needed; `--encoder-scenes 0` keeps the whole encoder random), and prepares the scenes with that
weights file through `--encoder-weights PATH`, as a user would their own VGG; then trains a
soft-attention decoder on the frozen features at `fit`'s defaults with the scenes' object
boxes (`fit --boxes`); with `--tune-minutes M` a second stage continues from its best weights,
training the decoder together with the encoder's conv5 layers (`fit --init ... --fine-tune-encoder`)
at lower learning rates. It then picks how sharp the maps are when the model decodes, softmax(k e)
for k in `SHARPNESS` (fit decodes at 3 with `--boxes`; 1 is the maps as trained): the k that names
the most validation scenes right among those whose maps still point at `MIN_POINTING` or more.
The build scores the result on the held-out test scenes (the
coco-caption metrics, pointing against the boxes, whether a caption's maps reach both of two
objects it names, and scene accuracy: the share of scenes whose caption names exactly their
objects, by `tools.judge`) and writes `captioner/assets/demo/` (an exported folder:
weights, the trained encoder layers in fp16 (the layers its pretraining left at their seeded values
are drawn again at load), no optimizer state, with a model card) and, as example images, the first
six scenes of `tools.demo_examples.EXAMPLES_SEED`, a seed fixed before the model was scored, never chosen by
hand; the card records for each the caption the saved model writes and whether it is right.
The card names the command and the commit that made the model, and the machine; nothing in the
folder names a path of the machine it was built on. With `--work DIR`, what a previous build
left there (scenes, the pretrained encoder, features, a training stage that ran to its end) is
reused, and a stage that did not finish is trained again from its start, so the model does not
depend on interruptions.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import Annotated

import torch

from captioner.evaluation.evaluate import evaluate, results_path
from captioner.models.checkpoint import carry_encoder_weights, load_checkpoint, save_checkpoint
from captioner.models.encoder import EncoderSpec
from captioner.options import Device, add_options, check_device, choose_device, from_args
from captioner.serve.export import export
from captioner.serve.sources import DEMO_MODEL, EXAMPLES_DIR
from captioner.train.config import TrainConfig
from captioner.train.finetune import FineTuneConfig
from tools import judge as scenes
from tools import pretrain_encoder as pretrain
from tools.demo_examples import EXAMPLES_SEED, draw_examples, judge_examples
from tools.scene_runs import finished, prepared, scene_set, trained

TUNE_LR, TUNE_ENCODER_LR = 2e-4, 1e-5  # the second stage's: the decoder at a fifth of its rate
SCORES = ("BLEU-1", "BLEU-4", "METEOR", "ROUGE-L", "CIDEr", "pointing", "two_objects")
SHARPNESS = (1.0, 1.5, 2.0, 3.0)  # decoding's softmax(k e) tried on the validation scenes
MIN_POINTING = 0.9  # the least pointing accuracy a chosen sharpness may give on them


@dataclass
class BuildOptions:
    """`python -m tools.build_demo`'s options."""

    n: Annotated[int, "synthetic scenes to generate"] = 8000
    seed: Annotated[int, "seed of the scenes, the training and the examples drawn"] = 0
    epochs: Annotated[int, "first stage's most epochs (frozen encoder); it stops early when validation stalls"] = 20
    patience: Annotated[int, "validations without improvement before a stage stops early"] = 4
    minutes: Annotated[float, "first stage's most minutes (0: none; a limit ties the model to the machine)"] = 0.0
    tune_minutes: Annotated[float, "second stage's budget: decoder and conv5 from the first's best (0: none)"] = 0.0
    encoder_scenes: Annotated[int, "training scenes the conv5 block is pretrained on (0: a random encoder)"] = 1600
    encoder_epochs: Annotated[int, "most epochs of the encoder's pretraining"] = 12
    encoder_minutes: Annotated[float, "the encoder's pretraining budget: no epoch starts after it"] = 120.0
    examples: Annotated[int, f"example scenes: the first N of the scenes of seed {EXAMPLES_SEED}"] = 6
    device: Device = "auto"
    work: Annotated[str | None, "keep the scenes, features and runs here (default: a temporary directory)"] = None

    def __post_init__(self):
        check_device(self.device)

    @property
    def command(self) -> str:
        return (
            f"python -m tools.build_demo --n {self.n} --seed {self.seed} --epochs {self.epochs} "
            f"--patience {self.patience} --minutes {self.minutes:g} --tune-minutes {self.tune_minutes:g} "
            f"--encoder-scenes {self.encoder_scenes} --encoder-epochs {self.encoder_epochs} "
            f"--encoder-minutes {self.encoder_minutes:g} --device {self.device}"
        )


def build(opts: BuildOptions, work: str, *, model_dir: str = DEMO_MODEL, examples_dir: str = EXAMPLES_DIR) -> dict:
    """Make the demo model (an exported folder) and its examples; returns the model card."""
    t0, device = time.monotonic(), str(choose_device(opts.device))
    src = scene_set(os.path.join(work, "scenes"), opts.n, opts.seed)
    encoder, pretrained = _encoder(opts, src, work, device)
    data = prepared(src, os.path.join(work, "data"), device=device, progress=True, encoder=encoder)
    boxes = os.path.join(src, "boxes.json")
    reused = finished(os.path.join(work, "run"))
    objects = scenes.read_objects(boxes)
    best, decoding = choose_sharpness(_train(opts, work, data, boxes, device), data, boxes, objects, device)
    metrics_path = os.path.join(os.path.dirname(best), "test_metrics.json")
    metrics = evaluate(best, data, "test", metrics_path, grounding=boxes, device=device)
    test_words = _words(metrics_path)
    ck = _packed(load_checkpoint(best))
    ck["card"] = {
        "trained_on": f"{opts.n} synthetic scenes of coloured shapes (python -m captioner.scenes.synthetic OUT "
        f"--n {opts.n} --seed {opts.seed}), features from "
        + (pretrain.trained_on(pretrained) if pretrained else "the seeded random VGG16 (--encoder-weights none)")
        + ", object boxes teaching the maps (fit --boxes)"
        + (", its conv5 layers then trained on the scenes with the decoder" if opts.tune_minutes else ""),
        "limits": "knows coloured shapes only (one to three per picture, seven colours, five shapes); real photos "
        "need a model trained on photos, such as COCO (python train.py coco ROOT)",
        "rebuild": opts.command,
        "commit": _commit(),
        "built_on": f"{device}: {_machine(device)}, torch {torch.__version__}, {time.monotonic() - t0:.0f} s"
        + (" (the scenes, features and training reused from an earlier run's --work directory)" if reused else ""),
        "decoding": decoding,
        "scored_with": _scored_with(metrics["decoding"]),
        **({"encoder_pretraining": pretrain.card_record(pretrained)} if pretrained else {}),
        "stages": _stage_steps(work, opts.tune_minutes),
        "test_metrics": {k: metrics[k] for k in SCORES if k in metrics},
        "test_images": metrics["images"],
        "attention_health": metrics["attention_health"],
        "scene_accuracy": scenes.accuracy(test_words, objects),
        "scene_accuracy_by_objects": _by_count(test_words, objects),
    }
    packed = os.path.join(work, "demo.pt")
    save_checkpoint(ck, packed)
    export(packed, model_dir)
    paths, drawn = draw_examples(opts.examples, examples_dir)
    # Judged with the exported fp16 model on the copied files: what the page shows for each example.
    ck["card"]["examples"] = judge_examples(model_dir, paths, drawn)
    save_checkpoint(ck, packed)
    export(packed, model_dir)
    return ck["card"]


def _encoder(opts: BuildOptions, scenes_dir: str, work: str, device: str) -> tuple[EncoderSpec, dict | None]:
    """The encoder `prepare` gets: VGG16 with its conv5 block pretrained on the scenes (a weights file,
    as a user's own VGG would be), or the seeded random one; and the pretraining's report."""
    if not opts.encoder_scenes:
        return EncoderSpec(weights="none"), None
    cfg = pretrain.PretrainConfig(
        scenes=opts.encoder_scenes, epochs=opts.encoder_epochs, minutes=opts.encoder_minutes, seed=opts.seed
    )
    path, report = pretrain.pretrain(scenes_dir, os.path.join(work, "encoder"), cfg, device=device)
    return EncoderSpec(arch="vgg16", weights=path), report


def _train(opts: BuildOptions, work: str, data: str, boxes: str, device: str) -> str:
    """The stages; returns the best.pt of the last."""
    first = TrainConfig.of(epochs=opts.epochs, max_minutes=opts.minutes or None, patience=opts.patience, seed=opts.seed)
    # Bounded by epochs alone, an interrupted stage goes on from its last.pt and ends as if it had not
    # stopped; bounded by minutes, it trains again from its start.
    run = os.path.join(work, "run")
    best = trained(data, run, None, first, boxes=boxes, resume=not opts.minutes, device=device, progress_bar=True)
    if not opts.tune_minutes:
        return best
    second = TrainConfig.of(
        epochs=1000,
        max_minutes=opts.tune_minutes,
        patience=1000,
        seed=opts.seed,
        lr=TUNE_LR,
        fine_tune=FineTuneConfig(lr=TUNE_ENCODER_LR),
    )
    tuned = os.path.join(work, "tuned")
    return trained(data, tuned, None, second, init=best, boxes=boxes, resume=False, device=device, progress_bar=True)


def choose_sharpness(best: str, data: str, boxes: str, objects: dict, device: str) -> tuple[str, str]:
    """The checkpoint at the decoding sharpness chosen on the validation scenes, and a sentence
    saying how it was chosen (for the card)."""
    trials, trained_ck = [], load_checkpoint(best)
    for k in SHARPNESS:
        ck = {**trained_ck, "decoder": {**trained_ck["decoder"], "decode_sharpness": k}}
        path = os.path.join(os.path.dirname(best), f"decode-{k:g}.pt")
        save_checkpoint(ck, path)
        out = os.path.join(os.path.dirname(best), f"val-decode-{k:g}.json")
        val = evaluate(path, data, "val", out, grounding=boxes, device=device)
        ck["metrics"] = {**ck["metrics"], **{m: val[m] for m in SCORES if m in val}}  # as it decodes now
        save_checkpoint(ck, path)
        trials.append((scenes.accuracy(_words(out), objects), val["pointing"], k, path))
    pointing_ok = [t for t in trials if t[1] >= MIN_POINTING] or trials
    right, pointing, k, path = max(pointing_ok)
    tried = "; ".join(f"k = {t[2]:g}: {t[0]:.1%} right, pointing {t[1]:.3f}" for t in trials)
    maps = "the maps as trained, softmax(e)" if k == 1 else f"maps softmax({k:g} e)"
    return path, (
        f"it decodes with {maps}: of the sharpness k of softmax(k e) tried on the {val['images']} validation "
        f"scenes ({tried}), the k naming the most scenes right with pointing at least {MIN_POINTING:g}"
    )


def _scored_with(decoding: dict) -> str:
    """How the card's scores were decoded, in words."""
    ranked = "log-probability per word" if decoding["length_norm"] else "total log-probability"
    return f"beam search of width {decoding['beam_size']}, beams ranked by {ranked}"


def _words(metrics_path: str) -> dict[int, list[str]]:
    """Image id → caption words, from the results beside an evaluation's metrics."""
    with open(results_path(metrics_path), encoding="utf-8") as f:
        return {r["image_id"]: r["caption"].split() for r in json.load(f)}


def _by_count(words: dict, objects: dict) -> dict[str, float]:
    """Scene accuracy of the scenes with one, two and three objects."""
    counts = sorted({len(objects[i]) for i in words})
    return {str(c): scenes.accuracy({i: w for i, w in words.items() if len(objects[i]) == c}, objects) for c in counts}


def _stage_steps(work: str, tune_minutes: float) -> dict:
    """Steps each training stage ran, and the step its best.pt is from."""
    out = {}
    for name, stage in (("frozen encoder", "run"), ("conv5 fine-tuned", "tuned"))[: 2 if tune_minutes else 1]:
        with open(os.path.join(work, stage, "metrics.jsonl"), encoding="utf-8") as f:
            end = [e for e in map(json.loads, f) if e.get("event") == "end"][-1]
        out[name] = {
            "steps": int(end["step"]),
            "best_step": int(load_checkpoint(os.path.join(work, stage, "best.pt"))["step"]),
        }
    return out


def _packed(ck: dict) -> dict:
    """The checkpoint without its training state or anything naming the building machine's paths;
    weights and trained encoder layers in fp16."""
    keep = {k: v for k, v in ck.items() if k not in ("format", "optimizer", "scheduler", "rng", "training_model")}
    keep.pop("command", None)  # the card's `rebuild` says how it was made
    files = {k: ck["data"][k] and os.path.basename(ck["data"][k]) for k in ("init", "boxes")}
    keep["data"] = {"fingerprint": ck["data"]["fingerprint"], **files}
    keep["model"] = _half(ck["model"])
    if "encoder_state" in ck:
        keep["encoder_state"] = _half(ck["encoder_state"])  # loaded into the fp32 encoder as floats
    return carry_encoder_weights(keep)  # the pretrained encoder's file, carried: the folder needs no path


def _half(state: dict) -> dict:
    return {k: v.half() if v.is_floating_point() else v for k, v in state.items()}


def _commit() -> str:
    """The commit of the checkout the build ran from (and whether it had changes), or 'unknown'."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here, capture_output=True)
    except OSError:
        return "unknown"
    if head.returncode:
        return "unknown"
    return head.stdout.strip() + (" with uncommitted changes" if dirty.stdout.strip() else "")


def _machine(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        name = platform.processor() or platform.machine()
    return f"{name}, {os.cpu_count()} cores"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m tools.build_demo", description=__doc__.split("\n")[0])
    add_options(p, BuildOptions)
    opts = from_args(BuildOptions, p.parse_args(argv))
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    with tempfile.TemporaryDirectory() as tmp:
        card = build(opts, opts.work or tmp)
    print(f"wrote {DEMO_MODEL} and {EXAMPLES_DIR}")
    right = sum(e["correct"] for e in card["examples"])
    print(f"examples right: {right} of {len(card['examples'])}; test scenes right: {card['scene_accuracy']:.1%}")
    print(json.dumps({k: v for k, v in card.items() if k != "examples"}, indent=1))


if __name__ == "__main__":
    main()
