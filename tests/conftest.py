"""Shared fixtures: a small synthetic COCO-format set, prepared once with the seeded random encoder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from captioner.models.decoder import DecoderConfig, step_mask
from captioner.models.encoder import EncoderSpec
from captioner.objectives.objective import attention_penalty
from captioner.objectives.terms import TermState
from captioner.scenes.synthetic import generate
from captioner.train.checkpoints import Live
from captioner.train.config import TrainConfig
from captioner.train.distributed import Dist, Process
from captioner.train.prepare import PrepareConfig, prepare
from captioner.train.resume import Start, settle
from captioner.train.setup import teacher_forced_objective
from captioner.train.step import TrainStep, make_optimizer
from captioner.train.trainer import FitJob, fit

REPO = Path(__file__).resolve().parents[1]

# The small decoder that the command-line tests train with `fit`, validated by a greedy search.
SMALL_FIT = ["--embed-dim", "32", "--hidden-dim", "48", "--attention-dim", "24", "--val-beam-size", "1"]

torch.set_num_threads(min(2, os.cpu_count() or 1))


def run_cli(*args: str, cwd: Path = REPO, **kw) -> subprocess.CompletedProcess:
    """Run `python <args>` as a user would, capturing output."""
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, **kw)


def train_step(
    decoder, cfg: TrainConfig | None = None, *, encoder=None, extra=(), views=True, device="cpu", compiled=None
):
    """The step `fit` would run on `decoder` (and a fine-tuned encoder's `extra` parameters) with cfg's
    settled objective, optimizer and clipping, on one process."""
    device = torch.device(device)
    model_cfg = DecoderConfig(**decoder.config.to_dict())
    _, cfg = settle(model_cfg, cfg or TrainConfig(), Start(model_cfg.vocab_size), device)
    views = views and cfg.terms.consistency > 0
    objective = teacher_forced_objective(decoder, cfg, views=views, state=TermState(device), encoder=encoder)
    groups = [{"params": list(decoder.parameters())}] + [{"params": list(extra)}] * bool(extra)
    optimizer = make_optimizer(groups, cfg.optim.lr)
    live = Live(decoder, None, None, optimizer, None, torch.Generator(device).manual_seed(1), None)
    return TrainStep(objective, live, cfg.optim, Process(Dist(), device, compiled))


def prepare_scenes(scenes: Path, out: Path, **config) -> dict:
    """`prepare`, quietly, of a generated scene folder (images/, captions.json, splits.json) into
    `out`, with the seeded random VGG16 and no worker processes; `config` sets other fields of
    `PrepareConfig` or overrides these."""
    config = {"encoder": EncoderSpec(weights="none"), "workers": 0, **config}
    return prepare(
        PrepareConfig(
            captions=[str(scenes / "captions.json")],
            images=[str(scenes / "images")],
            out=str(out),
            splits=str(scenes / "splits.json"),
            **config,
        ),
        progress=False,
    )


@pytest.fixture(scope="session")
def scenes(tmp_path_factory) -> Path:
    """48 synthetic scenes in COCO format (images, captions.json, splits.json, boxes.json)."""
    out = tmp_path_factory.mktemp("scenes")
    generate(str(out), 48, seed=11)
    return out


@pytest.fixture(scope="session")
def data_dir(scenes, tmp_path_factory) -> Path:
    """The scenes prepared: vocabulary and the feature cache of the seeded random VGG16."""
    out = tmp_path_factory.mktemp("data")
    prepare_scenes(scenes, out, min_count=1)
    return out


@pytest.fixture(scope="session")
def small_run(data_dir, tmp_path_factory) -> Path:
    """A tiny model trained for two epochs: it writes words, though not good ones yet."""
    out = tmp_path_factory.mktemp("run")
    fit(
        FitJob(
            str(data_dir),
            str(out),
            DecoderConfig(0, embed_dim=32, hidden_dim=48, attention_dim=24, dropout=0.1),
            TrainConfig.of(epochs=2, batch_size=8, lr=3e-3, val_beam_size=2),
            device="cpu",
            progress_bar=False,
        )
    )
    return out


def caption_loss(
    logits: torch.Tensor,
    alphas: torch.Tensor,
    captions: torch.Tensor,
    lengths: torch.Tensor,
    alpha_c: float = 1.0,
    words: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. (14) from `AttentionDecoder.forward`'s logits (B, T-1, V) and maps (B, T-1, L), written out
    plainly: the reference the objective's terms (`objectives.objective`) are held to.

    Returns:
        (negative log-likelihood per word, penalty per word); the loss is their sum.
    """
    B, T1, V = logits.shape
    mask = step_mask(lengths, T1)  # (B, T-1)
    nll = F.cross_entropy(logits.reshape(-1, V).float(), captions[:, 1 : T1 + 1].reshape(-1), reduction="none").view(
        B, T1
    )  # (B, T-1)
    words = mask.sum() if words is None else words
    return (nll * mask).sum() / words, attention_penalty(alphas.float(), mask, alpha_c).sum() / words
