"""The COCO recipe's stages (`train.py coco`), one function each: it returns what it produced, for
ROOT/recipe.json, or an exit status when it did not finish."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from typing import Annotated, Literal

import torch

from captioner.cli.run import TRAIN, TRAIN_MODULE
from captioner.data.archives import require_space
from captioner.data.fetch import COCO_2014, fetch
from captioner.errors import CaptionerError
from captioner.evaluation.evaluate import results_path
from captioner.io import read_json
from captioner.models.backbones import ARCH_HELP
from captioner.models.encoder import Arch, EncoderSpec

# fit's settings for COCO on one GPU (per process under torchrun), before --fit-args.
FIT = ("--epochs", "20", "--batch-size", "64", "--dropout", "0.5")
FIT_CUDA = ("--amp", "bf16")
# Room for the stages whose output does not grow with the data: checkpoints, scores, the export.
ROOM = {"fit": 2 * 10**9, "evaluate": 100 * 10**6, "export": 500 * 10**6}


@dataclass(frozen=True)
class CocoOptions:
    """The recipe's options (ROOT is its positional argument)."""

    gpus: Annotated[
        int | None, "GPUs on this machine: N > 1 runs prepare and fit under torchrun (default: one process)"
    ] = None
    mirror: Annotated[
        str | None,
        "base URL of a copy of COCO's files under their official relative paths (zips/train2014.zip, "
        "zips/val2014.zip, annotations/annotations_trainval2014.zip, caption_datasets.zip) and an optional "
        "SHA256SUMS, whose checksums then replace the official sizes and checksums",
    ] = None
    stage: Annotated[
        Literal["fetch", "prepare", "fit", "evaluate", "export"] | None,
        "run this stage only (default: every stage that has not finished)",
    ] = None
    images: Annotated[
        list[str] | None, "existing train2014 and val2014 image directories: the image zips are not fetched"
    ] = None
    captions: Annotated[
        list[str] | None,
        "existing captions_train2014.json and captions_val2014.json: the annotation zip is not fetched",
    ] = None
    splits: Annotated[str | None, "an existing Karpathy dataset_coco.json: caption_datasets.zip is not fetched"] = None
    encoder: Annotated[Arch, f"prepare's --encoder: {ARCH_HELP}"] = "vgg16"
    encoder_weights: Annotated[str, "prepare's --encoder-weights: imagenet, none (random, seeded) or a path"] = (
        "imagenet"
    )
    prepare_args: Annotated[str | None, "more options for prepare, in one string (--prepare-args='--no-views')"] = None
    fit_args: Annotated[
        str | None, "more options for fit, in one string, after the recipe's own (--fit-args='--epochs 30')"
    ] = None
    keep_zips: Annotated[bool, "keep the downloaded zips in ROOT/downloads after unpacking them"] = False

    def __post_init__(self):
        if self.gpus is not None and self.gpus < 1:
            raise CaptionerError(f"--gpus must be 1 or more, got {self.gpus}")


class Paths:
    """Where the recipe keeps what it makes, under ROOT."""

    def __init__(self, root: str):
        self.root, self.record = root, os.path.join(root, "recipe.json")
        self.data, self.run, self.model = (os.path.join(root, d) for d in ("data", "run", "model"))
        self.best, self.metrics = os.path.join(self.run, "best.pt"), os.path.join(self.run, "test_metrics.json")


def train_command(sub: str, args: list[str], gpus: int | None) -> list[str]:
    """The training CLI's `sub` command, under torchrun for `gpus` > 1."""
    if gpus and gpus > 1 and sub in ("prepare", "fit"):
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(gpus)]
        return [*torchrun, "-m", TRAIN_MODULE, sub, *args]
    return [*TRAIN, sub, *args]


def call(cmd: list[str]) -> int:
    """Print a command and run it; Ctrl-C and SIGTERM reach it and are waited for (it saves, then stops)."""
    print("$ " + shlex.join(cmd), flush=True)
    with subprocess.Popen(cmd) as p:
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: p.send_signal(signum))
        try:
            while True:
                with contextlib.suppress(KeyboardInterrupt):  # the child got the same Ctrl-C
                    return p.wait()
        finally:
            signal.signal(signal.SIGTERM, previous)


def java_warning() -> str | None:
    """What the scores lack without Java, or None when Java is there."""
    if shutil.which("java"):
        return None
    return (
        "no Java runtime (java) on PATH: coco-caption's PTB tokenizer and METEOR need it, so the scores "
        "written are not the official ones (no METEOR; BLEU, ROUGE-L and CIDEr on Python tokens). Install "
        "Java 8 or later, remove the metrics file and run --stage evaluate again for the official scores"
    )


def feature_bytes(arch: str) -> int:
    """One image's fp16 features on disk: (L, D) of the backbone's row (VGG: 196 × 512; ResNet: 196 × 2048)."""
    spec = EncoderSpec(arch=arch)
    return spec.grid**2 * spec.channels * 2


def _du(path: str) -> int:
    """Bytes allocated under `path` (a sparse feature file counts what it holds)."""
    return sum(os.stat(os.path.join(d, f)).st_blocks * 512 for d, _, files in os.walk(path) for f in files)


def _find(folder: str, filename: str) -> str:
    for d, _, files in os.walk(folder):
        if filename in files:
            return os.path.join(d, filename)
    return os.path.join(folder, filename)


def _inputs(opts: CocoOptions, root: str) -> dict:
    """The images, captions and split prepare reads: the user's copies, else what fetch unpacks."""
    return {
        "images": opts.images or [os.path.join(root, "train2014"), os.path.join(root, "val2014")],
        "captions": opts.captions
        or [_find(os.path.join(root, "annotations"), f"captions_{s}2014.json") for s in ("train", "val")],
        "splits": opts.splits or _find(os.path.join(root, "caption_datasets"), "dataset_coco.json"),
    }


def paths_of(outputs: dict) -> list[str]:
    """Every path a stage's outputs name (a value may be a path or a list of them)."""
    return [p for v in outputs.values() for p in (v if isinstance(v, list) else [v])]


def _missing(stage: str, paths: list[str], before: str) -> None:
    gone = [p for p in paths if not os.path.exists(p)]
    if gone:
        raise CaptionerError(f"{stage} needs {gone[0]}, which is not there: run {before} first (or the whole recipe)")


def _last_event(log: str) -> str | None:
    """The event of fit's last log line ("end" once it has finished), None without a log."""
    if not os.path.exists(log):
        return None
    with open(log, encoding="utf-8") as f:
        lines = f.read().splitlines()
    with contextlib.suppress(ValueError, IndexError, AttributeError):
        return json.loads(lines[-1]).get("event")
    return None


def _stopped(stage: str, status: int, how: str) -> int:
    print(f"{stage} stopped before it finished (exit status {status}); {how}", file=sys.stderr)
    return status or 1


def _fetch(opts: CocoOptions, paths: Paths) -> dict | int:
    given = {"train2014": opts.images, "val2014": opts.images, "annotations": opts.captions}
    given["caption_datasets"] = opts.splits
    remotes = [r for r in COCO_2014 if not given[r.folder]]
    fetch(remotes, paths.root, mirror=opts.mirror, keep=opts.keep_zips, progress=sys.stderr.isatty())
    inputs = _inputs(opts, paths.root)
    _missing("prepare", paths_of(inputs), "the fetch stage")
    return {"outputs": inputs}


def _prepare(opts: CocoOptions, paths: Paths) -> dict | int:
    inputs = _inputs(opts, paths.root)
    _missing("prepare", paths_of(inputs), "the fetch stage")
    extra = shlex.split(opts.prepare_args or "")
    images = sum(sum(1 for e in os.scandir(d) if e.is_file()) for d in inputs["images"])
    views = 1 if "--no-views" in extra or "--no-rotated" in extra else 2
    need = images * views * feature_bytes(opts.encoder) - (_du(paths.data) if os.path.isdir(paths.data) else 0)
    require_space(paths.data, max(0, need), f"prepare's features of {images:,} images (x{views} with their views)")
    args = ["--images", *inputs["images"], "--captions", *inputs["captions"], "--splits", inputs["splits"]]
    args += ["--out", paths.data, "--encoder", opts.encoder, "--encoder-weights", opts.encoder_weights, *extra]
    status = call(train_command("prepare", args, opts.gpus))
    meta = os.path.join(paths.data, "meta.json")
    if status or not (os.path.exists(meta) and read_json(meta, "data directory metadata").get("complete")):
        return _stopped("prepare", status, "run the same command again: it keeps the feature rows already made")
    return {"outputs": {"data": paths.data}}


def _fit(opts: CocoOptions, paths: Paths) -> dict | int:
    _missing("fit", [os.path.join(paths.data, "meta.json")], "the prepare stage")
    require_space(paths.run, ROOM["fit"], "fit's checkpoints")
    args = ["--data", paths.data, "--out", paths.run, *FIT, *(FIT_CUDA if torch.cuda.is_available() else ())]
    args += shlex.split(opts.fit_args or "")
    if os.path.exists(os.path.join(paths.run, "last.pt")):
        print(f"fit: going on from {os.path.join(paths.run, 'last.pt')}")
        args.append("--resume")
    status = call(train_command("fit", args, opts.gpus))
    ended = _last_event(os.path.join(paths.run, "metrics.jsonl")) == "end"
    if status or not ended or not os.path.exists(paths.best):
        return _stopped("fit", status, "run the same command again to go on from last.pt")
    return {"outputs": {"run": paths.run, "best": paths.best}}


def _evaluate(opts: CocoOptions, paths: Paths) -> dict | int:
    _missing("evaluate", [paths.best, os.path.join(paths.data, "meta.json")], "the fit stage")
    require_space(paths.run, ROOM["evaluate"], "evaluate's captions and scores")
    if warning := java_warning():
        print(f"warning: {warning}", file=sys.stderr)
    args = ["--checkpoint", paths.best, "--data", paths.data, "--split", "test", "--out", paths.metrics]
    status = call(train_command("evaluate", args, opts.gpus))
    if status or not os.path.exists(paths.metrics):
        return _stopped("evaluate", status, "run the same command again")
    m = read_json(paths.metrics, "metrics")
    scores = {k: m[k] for k in ("BLEU-4", "METEOR", "ROUGE-L", "CIDEr") if k in m}
    return {
        "outputs": {"metrics": paths.metrics, "captions": results_path(paths.metrics)},
        "official": m.get("official"),
        "scores": scores,
    }


def _export(opts: CocoOptions, paths: Paths) -> dict | int:
    _missing("export", [paths.best], "the fit stage")
    require_space(paths.model, ROOM["export"], "the exported model")
    status = call([sys.executable, "-m", "captioner", "export", paths.best, paths.model])
    files = [os.path.join(paths.model, f) for f in ("model.safetensors", "config.json", "README.md")]
    if status or not all(map(os.path.exists, files)):
        return _stopped("export", status, "run the same command again")
    return {"outputs": {"model": paths.model}}


RUNS = {"fetch": _fetch, "prepare": _prepare, "fit": _fit, "evaluate": _evaluate, "export": _export}
