"""`captioner selfcheck [--device cuda]`: does every training mode run on this machine's device?

It makes a few hundred synthetic scenes, prepares them with the seeded random encoder, then runs
each training mode briefly, exactly as a user runs it (`train.py prepare`, `fit`, `torchrun`,
`evaluate`, `captioner export`, `captioner caption`, each in its own process), and prints one
line per mode: whether it passed and its training steps per second. A fine-tuned model's
checkpoint is also captioned on the CPU, where its encoder layers must load too. Run it first on
a new GPU machine: a mode that fails here would fail on COCO after hours of preparation.
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

from captioner.options import Device, check_device

TRAIN = [sys.executable, "-m", "captioner.cli.train"]
CAPTIONER = [sys.executable, "-m", "captioner"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]


@dataclass
class SelfCheckOptions:
    """`captioner selfcheck`'s options."""

    device: Device = "cuda"
    scenes: Annotated[int, "synthetic scenes to make"] = 240
    seconds: Annotated[float, "how long each mode trains"] = 12.0
    work: Annotated[str | None, "keep the scenes, data and runs in this directory (default: a temporary one)"] = None
    only: Annotated[list[str] | None, "run only these modes (names as printed)"] = None

    def __post_init__(self):
        check_device(self.device)


@dataclass
class Mode:
    """One line of the check: a `fit` command line, and what else runs on its checkpoint."""

    name: str
    args: list[str]
    after: str | None = None  # a mode whose best.pt this one starts from (--init)
    torchrun: bool = False
    caption_on_cpu: bool = False  # also caption with the checkpoint on the CPU (fine-tuned encoders)


def modes(boxes: str) -> list[Mode]:
    """Every training mode, briefly: the defaults, hard attention, SCST, boxes, fine-tuning, precision, compile."""
    tune = ["--fine-tune-encoder", "--tune-after", "0"]
    return [
        Mode("soft", []),
        Mode("hard", ["--attention", "hard"]),
        Mode("scst", ["--objective", "scst"], after="soft"),
        Mode("boxes", ["--boxes", boxes]),
        Mode("tune-conv5_1", tune, caption_on_cpu=True),
        Mode("tune-conv4_1", [*tune, "--fine-tune-from", "conv4_1"], caption_on_cpu=True),
        Mode("tune-boxes", [*tune, "--boxes", boxes], caption_on_cpu=True),
        Mode("bf16", ["--amp", "bf16"]),
        Mode("compile", ["--compile"]),
        Mode("torchrun", [], torchrun=True),
    ]


def _run(command: list[str], log) -> None:
    """Run one command, its output to the log; raise with its last lines when it fails."""
    log.write("$ " + " ".join(command) + "\n")
    log.flush()
    p = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if p.returncode != 0:
        raise RuntimeError(f"`{' '.join(command[2:5])} ...` exited with {p.returncode}")


def steps_per_second(run: str) -> float | None:
    """Training steps per second from a run's metrics.jsonl (start to its last training line)."""
    lines = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"), encoding="utf-8")]
    trained = [x for x in lines if x.get("event") == "train"]
    if not trained or not trained[-1]["time"]:
        return None
    return trained[-1]["step"] / trained[-1]["time"]


def check_mode(mode: Mode, work: str, opts: SelfCheckOptions, log) -> str:
    """Train one mode, then evaluate, export and caption with what it made; the result's line."""
    data, run = os.path.join(work, "data"), os.path.join(work, "runs", mode.name)
    shutil.rmtree(run, ignore_errors=True)
    fit = ["fit", "--data", data, "--out", run, "--device", opts.device, "--max-minutes", str(opts.seconds / 60)]
    fit += ["--val-images", "8", "--val-beam-size", "2", "--log-every", "1", *mode.args]
    if mode.after:
        init = os.path.join(work, "runs", mode.after, "best.pt")
        if not os.path.exists(init):
            raise RuntimeError(f"needs the {mode.after} mode's model: run that mode too")
        fit += ["--init", init]
    _run([*(TORCHRUN if mode.torchrun else [sys.executable]), "-m", "captioner.cli.train", *fit], log)
    best = os.path.join(run, "best.pt")
    metrics = os.path.join(run, "test", "metrics.json")
    _run([*TRAIN, "evaluate", "--checkpoint", best, "--data", data, "--out", metrics, "--device", opts.device], log)
    exported = os.path.join(run, "model")
    _run([*CAPTIONER, "export", best, exported], log)
    image = sorted(os.listdir(os.path.join(work, "scenes", "images")))[0]
    image = os.path.join(work, "scenes", "images", image)
    for device in [opts.device, *(["cpu"] if mode.caption_on_cpu and opts.device != "cpu" else [])]:
        _run([*CAPTIONER, "caption", image, "--checkpoint", exported, "--device", device], log)
    rate = steps_per_second(run)
    return f"{'' if rate is None else f'{rate:.1f} steps/s'}"


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
            prepare = ["prepare", "--images", os.path.join(scenes, "images"), "--captions"]
            prepare += [os.path.join(scenes, "captions.json"), "--splits", os.path.join(scenes, "splits.json")]
            _run([*TRAIN, *prepare, "--out", data, "--encoder-weights", "none", "--device", opts.device], log)
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
