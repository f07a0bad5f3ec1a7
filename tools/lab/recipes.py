"""Small synthetic training runs for the notebooks: scenes, features and a model, each made once.

`synthetic_run(root, "soft" | "hard")` gives a trained checkpoint to look at in seconds (tiny
recipe, 112×112 encoder input) or in minutes (`long=True`, the 14×14 grid), reusing whatever a
previous run left in `root`; `synthetic_scst_run(root)` continues the quick soft model with
self-critical training, to show its reward curve.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
from PIL import Image

from captioner.data.dataset import CaptionData
from captioner.decoding.settings import Decoding
from captioner.errors import CaptionerError
from captioner.evaluation.metrics import caption_split
from captioner.io import read_json
from captioner.models.decoder import DecoderConfig
from captioner.models.encoder import EncoderSpec
from captioner.serve.api import Caption, Captioner
from captioner.train.config import TrainConfig
from tools.scene_runs import prepared, scene_set, trained

WORK_ENV = "CAPTIONER_NOTEBOOK_DIR"  # where notebooks write scenes, features and runs


@dataclass
class Recipe:
    """A synthetic training setup: which scenes, the encoder input size and the model."""

    scenes: int
    seed: int
    image_size: int  # 112 gives a 7×7 grid at a quarter of 224's cost
    min_count: int  # rarer words become <unk>
    decoder: DecoderConfig
    train: TrainConfig
    name: str
    # Torch threads while training (None: torch's default). A tiny model runs several times
    # faster on one: its ops are too small to split, and threads contend with other work.
    threads: int | None = None


def recipe(attention: str = "soft", long: bool = False) -> Recipe:
    """The notebooks' training setups.

    Both leave out the doubly stochastic penalty (alpha_c = 0): with captions of 3-10 words
    over 49 or 196 cells, Σ_i (1 − Σ_t α_ti)² is smallest when every map is spread evenly,
    and in runs this short it keeps attention near uniform.

    Args:
        attention: "soft" or "hard".
        long: False: 200 scenes at 112×112 (a 7×7 grid) and a model that trains in under
            a minute (for CI and a first look); True: 2000 scenes at 224×224 (the paper's 14×14
            grid), up to 15 minutes of training per model.
    """
    if long:
        return Recipe(
            2000,
            0,
            224,
            5,
            DecoderConfig(0, embed_dim=128, hidden_dim=256, attention_dim=128, dropout=0.3, attention=attention),
            TrainConfig.of(
                epochs=40,
                batch_size=32,
                lr=2e-3,
                alpha_c=0.0,
                max_minutes=15,
                patience=6,
                val_beam_size=3,
                log_every=10,
            ),
            name=f"{attention}-long",
        )
    # ~25 s of training; the time budget makes a loaded CPU end the run early rather than late.
    return Recipe(
        200,
        1,
        112,
        3,
        DecoderConfig(0, embed_dim=64, hidden_dim=128, attention_dim=64, dropout=0.1, attention=attention),
        TrainConfig.of(
            epochs=15, batch_size=32, lr=4e-3, alpha_c=0.0, max_minutes=0.75, patience=100, val_beam_size=1, log_every=5
        ),
        name=f"{attention}-quick",
        threads=1,
    )


def work_dir() -> str:
    """The notebooks' working directory: $CAPTIONER_NOTEBOOK_DIR, else <tmp>/captioner-notebooks."""
    path = os.environ.get(WORK_ENV) or os.path.join(tempfile.gettempdir(), "captioner-notebooks")
    os.makedirs(path, exist_ok=True)
    return path


def synthetic_scenes(root: str, n: int, seed: int) -> str:
    """Generate n synthetic scenes under root (reused if already there); returns their directory."""
    return scene_set(os.path.join(root, f"scenes-n{n}-s{seed}"), n, seed)


def scene_images(root: str, n: int = 6, seed: int = 1234) -> list[str]:
    """Paths of n synthetic scenes (made under root if needed): images to caption."""
    out = synthetic_scenes(root, n, seed)
    return [
        os.path.join(out, "images", im["file_name"])
        for im in read_json(os.path.join(out, "captions.json"), "COCO captions")["images"]
    ]


def synthetic_data(root: str, rec: Recipe) -> tuple[str, str]:
    """Scenes and their prepared data directory (features, vocabulary) for a recipe, made once.

    Returns:
        (scenes directory, data directory).
    """
    scenes = synthetic_scenes(root, rec.scenes, rec.seed)
    data = os.path.join(root, f"data-n{rec.scenes}-s{rec.seed}-{rec.image_size}")
    encoder = EncoderSpec(weights="none", image_size=rec.image_size)
    return scenes, prepared(scenes, data, encoder=encoder, min_count=rec.min_count, workers=0)


def train_or_load(data_dir: str, run_dir: str, rec: Recipe, init: str | None = None) -> str:
    """Train a recipe's model into run_dir (from `init`'s weights, if given) unless it finished there already;
    returns its best.pt. An interrupted run goes on from its last checkpoint rather than starting a second log."""
    return trained(data_dir, run_dir, rec.decoder, rec.train, init=init, threads=rec.threads)


class SyntheticRun(NamedTuple):
    """Where `synthetic_run` put things."""

    scenes: str  # images, captions.json, splits.json, boxes.json
    data: str  # the prepared data directory
    run: str  # best.pt, last.pt, metrics.jsonl
    checkpoint: str  # run/best.pt


def synthetic_run(root: str, attention: str = "soft", long: bool = False) -> SyntheticRun:
    """Scenes, features and a trained model of `recipe(attention, long)` under root, each made once."""
    rec = recipe(attention, long)
    scenes, data = synthetic_data(root, rec)
    run = os.path.join(root, f"run-{rec.name}")
    return SyntheticRun(scenes, data, run, train_or_load(data, run, rec))


def synthetic_scst_run(root: str) -> SyntheticRun:
    """The quick soft model continued by self-critical training (`fit --objective scst --init
    best.pt`), made once: about half a minute at most, for the notebooks' reward curve."""
    base = synthetic_run(root, "soft")
    # lr 1e-3 rather than the 5e-5 default: a model this small and a run this short move
    # visibly only with a larger step.
    scst = TrainConfig.of(
        objective="scst",
        epochs=8,
        batch_size=16,
        lr=1e-3,
        max_minutes=0.5,
        patience=100,
        val_beam_size=1,
        log_every=2,
    )
    rec = replace(recipe("soft"), train=scst, name="soft-quick-scst")
    run = os.path.join(root, f"run-{rec.name}")
    return SyntheticRun(base.scenes, base.data, run, train_or_load(base.data, run, rec, init=base.checkpoint))


class SplitCaption(NamedTuple):
    """A caption of an image of a prepared split, with the image's path."""

    image_id: int
    path: str
    caption: Caption


def caption_split_images(
    checkpoint: str,
    data_dir: str,
    split: str = "test",
    *,
    beam_size: int = 3,
    mode: str | None = None,
    max_images: int | None = None,
) -> list[SplitCaption]:
    """Caption a split from its cached features (no encoder needed), as `evaluate` does.

    Args:
        checkpoint: a model trained on features of the same encoder as data_dir's.
        mode: "expected", "argmax" or "sample" (default: the model's own).

    Returns:
        One entry per image, by image id; hard modes fill `caption.locations`.
    """
    cap = Captioner.load(checkpoint, build_encoder=False)
    data = CaptionData(data_dir)
    if data.encoder.fingerprint != cap.encoder_spec.fingerprint:
        raise CaptionerError(f"{checkpoint} was trained on other features than those in {data_dir}")
    ids, rows = data.split_images(split)
    path_of = {int(i): data.path_of(int(r)) for i, r in zip(ids, rows)}
    texts, hyps = caption_split(
        cap.decoder,
        data,
        cap.vocab,
        split,
        decoding=Decoding(beam_size=beam_size, mode=mode),
        max_len=cap.max_len,
        max_images=max_images,
    )
    g = cap.encoder_spec.grid
    out = []
    for image_id in sorted(hyps):
        h = hyps[image_id]
        words = cap.vocab.decode(h.tokens)
        locs = [divmod(int(l), g) for l in h.locations] if (np.asarray(h.locations) >= 0).any() else None
        with Image.open(path_of[image_id]) as im:
            size = im.size
            if im.getexif().get(0x0112) in (5, 6, 7, 8):  # EXIF orientations that turn by 90°
                size = size[::-1]
        out.append(
            SplitCaption(
                image_id,
                path_of[image_id],
                Caption(
                    text=texts[image_id],
                    words=words,
                    score=h.score,
                    attention=h.attention.reshape(len(words), g, g),
                    locations=locs,
                    size=size,
                ),
            )
        )
    return out


def attention_warning(checkpoint: str) -> str | None:
    """What to say beside a model's heatmaps when `fit` found them not meaningful (else None)."""
    return Captioner.load(checkpoint, build_encoder=False).attention_warning
