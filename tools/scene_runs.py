"""Generated scenes → prepared features → a trained model, each made once: the recipe the notebooks
(`tools.lab.recipes`) and the demo model's build (`tools.build_demo`) share.

Each step leaves what it made in the directory it is given and, run again, finds it there:
scenes are complete once their boxes.json is written (the generator writes it last), a data
directory once its meta.json says so, and a run once its metrics.jsonl ends with the run's end.
A run that did not end is resumed from its last.pt, or, where a run's result must not depend
on how often it was interrupted (the demo build's time budgets), trained again from the start.
"""

from __future__ import annotations

import json
import os
import shutil

import torch

from captioner.io import read_json
from captioner.models.decoder import DecoderConfig
from captioner.models.encoder import EncoderSpec
from captioner.scenes.synthetic import generate
from captioner.train.config import TrainConfig
from captioner.train.prepare import PrepareConfig, prepare
from captioner.train.trainer import FitJob, fit


def scene_set(out: str, n: int, seed: int) -> str:
    """n scenes of `python -m captioner.scenes.synthetic OUT --n N --seed SEED` in `out`, made once."""
    if not os.path.isfile(os.path.join(out, "boxes.json")):  # written last
        generate(out, n, seed=seed)
    return out


def prepared(scenes: str, out: str, *, progress: bool = False, **settings) -> str:
    """The scenes' data directory (vocabulary and the seeded random encoder's features), made once.

    Args:
        settings: `PrepareConfig` fields (e.g. encoder, min_count, workers, device).
    """
    meta = os.path.join(out, "meta.json")
    if not (os.path.isfile(meta) and read_json(meta, "data directory metadata").get("complete")):
        settings = {"encoder": EncoderSpec(weights="none"), **settings}
        prepare(
            PrepareConfig(
                captions=[os.path.join(scenes, "captions.json")],
                images=[os.path.join(scenes, "images")],
                out=out,
                splits=os.path.join(scenes, "splits.json"),
                **settings,
            ),
            progress=progress,
        )
    return out


def finished(run: str) -> bool:
    """Whether `run` holds a training that ended on its own (not stopped, not killed)."""
    log = os.path.join(run, "metrics.jsonl")
    if not (os.path.isfile(log) and os.path.isfile(os.path.join(run, "best.pt"))):
        return False
    with open(log, encoding="utf-8") as f:
        events = [json.loads(line).get("event") for line in f if line.strip()]
    last_start = len(events) - 1 - events[::-1].index("start") if "start" in events else 0
    return bool(events) and events[-1] == "end" and "stopped" not in events[last_start:]


def trained(
    data: str,
    run: str,
    model: DecoderConfig | None,
    cfg: TrainConfig,
    *,
    init: str | None = None,
    boxes: str | None = None,
    resume: bool = True,
    device: str = "cpu",
    threads: int | None = None,
    progress_bar: bool = False,
) -> str:
    """A model trained on `data` into `run` (its best.pt), unless a finished one is there.

    Args:
        init, boxes: `fit`'s.
        resume: go on from the last.pt of a run that did not end (else train it again from the start).
        threads: torch threads while training (None: as they are).
    """
    best = os.path.join(run, "best.pt")
    if finished(run):
        return best
    again = resume and os.path.isfile(os.path.join(run, "last.pt"))
    if not again:
        shutil.rmtree(run, ignore_errors=True)
    before = torch.get_num_threads()
    try:
        if threads:
            torch.set_num_threads(threads)
        fit(FitJob(data, run, model, cfg, init, boxes, again, device, progress_bar))
    finally:
        torch.set_num_threads(before)
    return best
