"""`captioner selfcheck [--device cuda]`: does every training mode run on this machine's device?

Run it first on a new GPU machine: a mode that fails here would fail on COCO after hours of preparation.
Each mode trains briefly on synthetic scenes, each command in its own process as a user runs it, and
fails where a compiled function fell back to eager work (`captioner.compiled`), naming the function and why.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Annotated

from captioner.cli.run import TRAIN, TRAIN_MODULE
from captioner.compiled import FELL_BACK
from captioner.options import Device

CAPTIONER = [sys.executable, "-m", "captioner"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
VAL_IMAGES = 1000  # more than the scenes' validation split holds: fit validates on all of it
# How far fit's compiled validation of best.pt may be from `evaluate`'s uncompiled one. Compiled kernels
# round differently from ATen's (a few ulps), so a beam near a tie can flip and change a caption of the
# two dozen validation scenes: each moves BLEU-4 and CIDEr by up to about this much. Validating other
# weights than best.pt's (a stale copy of the average) changes most captions, and the scores far more.
TIES = {"BLEU-4": 0.05, "CIDEr": 0.25}


@dataclass(frozen=True)
class SelfCheckOptions:
    device: Device = "cuda"
    scenes: Annotated[int, "synthetic scenes to make"] = 240
    seconds: Annotated[float, "how long each mode trains"] = 12.0
    work: Annotated[str | None, "keep the scenes, data and runs in this directory (default: a temporary one)"] = None
    only: Annotated[list[str] | None, "run only these modes (names as printed)"] = None


@dataclass
class Mode:
    """One line of the check: a `fit` command line, and what else runs on its checkpoint."""

    name: str
    args: list[str]
    after: str | None = None  # a mode whose best.pt this one starts from (--init)
    processes: int = 0  # run under torchrun with this many processes (0: a plain process)
    caption_on_cpu: bool = False  # also caption with the checkpoint on the CPU (fine-tuned encoders)
    same_validation: bool = False  # fit's validation of best.pt equals `evaluate`'s, uncompiled
    encoder: str = "vgg16"  # the backbone the scenes are prepared with (`prepare --encoder`)


def modes(boxes: str) -> list[Mode]:
    tune = ["--fine-tune-encoder", "--tune-after", "0"]
    scst = ["--objective", "scst"]
    return [
        Mode("soft", []),
        Mode("hard", ["--attention", "hard"]),
        Mode("scst", scst, after="soft"),
        Mode("scst-greedy", [*scst, "--scst-baseline", "greedy"], after="soft"),
        Mode("boxes", ["--boxes", boxes]),
        Mode("boxes-choice", ["--boxes", boxes, "--boxes-choice-weight", "1"]),
        Mode("tune-conv5_1", tune, caption_on_cpu=True),
        Mode("tune-conv4_1", [*tune, "--fine-tune-from", "conv4_1"], caption_on_cpu=True),
        Mode("tune-boxes", [*tune, "--boxes", boxes], caption_on_cpu=True),
        Mode("bf16", ["--amp", "bf16"]),
        Mode("bf16-scst", [*scst, "--amp", "bf16"], after="soft"),
        Mode("bf16-scst-greedy", [*scst, "--scst-baseline", "greedy", "--amp", "bf16"], after="soft"),
        Mode("compile", ["--compile"], same_validation=True),
        Mode("torchrun", [], processes=1),
        Mode("ddp-2", [], processes=2),
        Mode("resnet101", ["--boxes", boxes], encoder="resnet101"),
        Mode("resnet101-tune", tune, caption_on_cpu=True, encoder="resnet101"),
    ]


def _run(command: list[str], log) -> None:
    """Run one command, its output to the log; raise when it fails, or when a compiled function fell back in it."""
    log.write("$ " + " ".join(command) + "\n")
    log.flush()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    log.write(p.stdout)
    log.flush()
    if p.returncode != 0:
        said = [line for line in p.stdout.splitlines() if line.startswith("error: ")][-1:]
        raise RuntimeError(
            f"`{' '.join(command[2:5])} ...` exited with {p.returncode}" + "".join(f": {s}" for s in said)
        )
    fell_back = [line for line in p.stdout.splitlines() if FELL_BACK in line]
    if fell_back:
        raise RuntimeError(f"`{' '.join(command[2:5])} ...`: {fell_back[0].removeprefix('warning: ')}")


def _compile_failures(run: str) -> None:
    """Raise, naming the function and why, if a compiled function fell back in the run (metrics.jsonl)."""
    lines = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"), encoding="utf-8")]
    failed = [x["message"] for x in lines if x.get("event") == "compiled_failed"]
    if failed:
        raise RuntimeError(f"fit: {failed[0]}" + (f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""))


def steps_per_second(run: str) -> float | None:
    """From a run's start to its last training line."""
    lines = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"), encoding="utf-8")]
    trained = [x for x in lines if x.get("event") == "train"]
    if not trained or not trained[-1]["time"]:
        return None
    return trained[-1]["step"] / trained[-1]["time"]


def data_dir(work: str, encoder: str) -> str:
    return os.path.join(work, "data" if encoder == "vgg16" else f"data-{encoder}")


def prepare_scenes(work: str, encoder: str, opts: SelfCheckOptions, log) -> None:
    """`prepare` the scenes with the seeded random `encoder`, unless done."""
    scenes, data = os.path.join(work, "scenes"), data_dir(work, encoder)
    if os.path.exists(os.path.join(data, "meta.json")):
        return
    prepare = ["prepare", "--images", os.path.join(scenes, "images"), "--captions"]
    prepare += [os.path.join(scenes, "captions.json"), "--splits", os.path.join(scenes, "splits.json")]
    prepare += ["--out", data, "--encoder", encoder, "--encoder-weights", "none", "--device", opts.device]
    _run([*TRAIN, *prepare], log)


def check_mode(mode: Mode, work: str, opts: SelfCheckOptions, log) -> str:
    """Train one mode, then evaluate, export and caption with what it made; the result's line."""
    prepare_scenes(work, mode.encoder, opts, log)
    data, run = data_dir(work, mode.encoder), os.path.join(work, "runs", mode.name)
    shutil.rmtree(run, ignore_errors=True)
    fit = ["fit", "--data", data, "--out", run, "--device", opts.device, "--max-minutes", str(opts.seconds / 60)]
    fit += ["--val-images", str(VAL_IMAGES), "--val-beam-size", "2", "--log-every", "1", *mode.args]
    if mode.after:
        init = os.path.join(work, "runs", mode.after, "best.pt")
        if not os.path.exists(init):
            raise RuntimeError(f"needs the {mode.after} mode's model: run that mode too")
        fit += ["--init", init]
    launch = [*TORCHRUN, str(mode.processes)] if mode.processes else [sys.executable]
    _run([*launch, "-m", TRAIN_MODULE, *fit], log)
    _compile_failures(run)
    best = os.path.join(run, "best.pt")
    metrics = os.path.join(run, "test", "metrics.json")
    _run([*TRAIN, "evaluate", "--checkpoint", best, "--data", data, "--out", metrics, "--device", opts.device], log)
    if mode.same_validation:
        _same_validation(run, data, opts.device, log)
    exported = os.path.join(run, "model")
    _run([*CAPTIONER, "export", best, exported], log)
    image = sorted(os.listdir(os.path.join(work, "scenes", "images")))[0]
    image = os.path.join(work, "scenes", "images", image)
    for device in [opts.device, *(["cpu"] if mode.caption_on_cpu and opts.device != "cpu" else [])]:
        _run([*CAPTIONER, "caption", image, "--checkpoint", exported, "--device", device], log)
    rate = steps_per_second(run)
    return f"{'' if rate is None else f'{rate:.1f} steps/s'}"


def _same_validation(run: str, data: str, device: str, log) -> None:
    """best.pt's validation as `fit` scored it (compiled on a GPU) equals `evaluate` of the same weights, eager."""
    # The training extras (pycocotools), which `captioner caption` does without.
    from captioner.data.dataset import CaptionData
    from captioner.evaluation.evaluate import results_path
    from captioner.evaluation.metrics import score_validation

    lines = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"), encoding="utf-8")]
    val = [x for x in lines if x.get("event") == "val"]
    best = next(x for x in reversed(val) if x["step"] == x["best_step"])
    out = os.path.join(run, "val", "metrics.json")
    where = ["--checkpoint", os.path.join(run, "best.pt"), "--data", data, "--out", out, "--split", "val"]
    _run([*TRAIN, "evaluate", *where, "--beam-size", "2", "--device", device, "--cuda-graphs", "off"], log)
    with open(results_path(out), encoding="utf-8") as f:
        texts = {r["image_id"]: r["caption"] for r in json.load(f)}
    again = score_validation(texts, CaptionData(data).references["val"])  # scored as fit scores
    differ = {k: (best[k], again[k]) for k, most in TIES.items() if abs(best[k] - again[k]) > most}
    if differ:
        raise RuntimeError(f"fit's validation of best.pt and evaluate's differ by more than {TIES}: {differ}")


def selfcheck(opts: SelfCheckOptions, out=sys.stdout) -> bool:
    """Run every mode on `opts.device`; print one line per mode; True when all passed."""
    work = opts.work or tempfile.mkdtemp(prefix="captioner-selfcheck-")
    os.makedirs(work, exist_ok=True)
    scenes, data = os.path.join(work, "scenes"), os.path.join(work, "data")
    passed = True
    with open(os.path.join(work, "selfcheck.log"), "a", encoding="utf-8") as log:
        print(
            f"selfcheck on {opts.device}: {opts.scenes} scenes in {work} (commands and output: selfcheck.log)", file=out
        )
        t0 = time.monotonic()
        if not os.path.exists(os.path.join(data, "meta.json")):
            _run(
                [sys.executable, "-m", "captioner.scenes.synthetic", scenes, "--n", str(opts.scenes), "--seed", "0"],
                log,
            )
            prepare_scenes(work, "vgg16", opts, log)
        print(f"{'prepare':<14} passed  {time.monotonic() - t0:.0f} s", file=out, flush=True)
        for mode in modes(os.path.join(scenes, "boxes.json")):
            if opts.only and mode.name not in opts.only:
                continue
            try:
                line = f"passed  {check_mode(mode, work, opts, log)}"
            except RuntimeError as e:
                line, passed = f"FAILED  {e}", False
            print(f"{mode.name:<14} {line}", file=out, flush=True)
    if not opts.work and passed:
        shutil.rmtree(work, ignore_errors=True)
    elif not passed:
        print(f"what each command printed: {os.path.join(work, 'selfcheck.log')}", file=out)
    return passed
