"""The weights' moving average (`fit --ema`): its update, and what checkpoints and validation hold."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from captioner.data.dataset import CaptionData
from captioner.decoding.settings import Decoding
from captioner.evaluation.metrics import caption_split, score_validation
from captioner.models.checkpoint import current_train, load_checkpoint, read_trained
from captioner.models.decoder import DecoderConfig
from captioner.train.config import TrainConfig
from captioner.train.step import WeightAverage
from captioner.train.trainer import FitJob, fit

SMALL = DecoderConfig(0, embed_dim=16, hidden_dim=16, attention_dim=8)


def test_average_moves_towards_the_weights_by_a_ramped_decay():
    model = nn.Linear(3, 2)
    average = WeightAverage(model, decay=0.9)
    before = average.model.weight.clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    average.update(model, step=1)  # early: keeps (1 + 1) / (10 + 1) of the average, not 0.9
    keep = 2 / 11
    assert torch.allclose(average.model.weight, keep * before + (1 - keep) * model.weight)
    middle = average.model.weight.clone()
    average.update(model, step=1000)  # late: the decay caps what it keeps
    assert torch.allclose(average.model.weight, 0.9 * middle + 0.1 * model.weight)
    assert not any(p.requires_grad for p in average.model.parameters())


@pytest.mark.parametrize("decay", [0.0, 1.0, -0.5])
def test_decays_outside_zero_to_one_are_refused(decay):
    if decay:  # 0 is off
        with pytest.raises(ValueError, match="--ema"):
            TrainConfig.of(ema=decay)
    else:
        assert TrainConfig.of(ema=decay).optim.ema == 0.0


@pytest.mark.slow
def test_checkpoints_hold_the_average_and_the_raw_weights_for_resume(data_dir, tmp_path):
    """best.pt and last.pt carry the average as their model (what validation scored and inference
    loads) and the optimizer's raw weights beside it; a resume goes on from both."""
    cfg = TrainConfig.of(epochs=2, batch_size=8, val_beam_size=1, ema=0.9)
    fit(FitJob(str(data_dir), str(tmp_path / "run"), SMALL, cfg, device="cpu", progress_bar=False))
    last = load_checkpoint(str(tmp_path / "run" / "last.pt"))
    raw, averaged = last["training_model"], last["model"]
    assert raw.keys() == averaged.keys()
    assert any(not torch.equal(raw[k], averaged[k]) for k in raw)
    # best.pt's model is the one validation scored: captioning the split again gives its score
    best = load_checkpoint(str(tmp_path / "run" / "best.pt"))
    data = CaptionData(str(data_dir))
    texts, _ = caption_split(
        read_trained(best, "best.pt").decoder,
        data,
        data.vocab,
        "val",
        decoding=Decoding(beam_size=1),
        max_len=data.max_len,
    )
    assert score_validation(texts, data.references["val"])["CIDEr"] == pytest.approx(best["progress"]["best"])

    cfg = TrainConfig.of(epochs=3, batch_size=8, val_beam_size=1, ema=0.9)
    fit(FitJob(str(data_dir), str(tmp_path / "run"), SMALL, cfg, resume=True, device="cpu", progress_bar=False))
    resumed = load_checkpoint(str(tmp_path / "run" / "last.pt"))
    assert resumed["step"] > last["step"]
    assert any(not torch.equal(resumed["model"][k], averaged[k]) for k in averaged)
    log = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in log if r["event"] == "val"]) == 3


@pytest.mark.slow
def test_without_the_average_checkpoints_hold_only_the_trained_weights(data_dir, tmp_path):
    cfg = TrainConfig.of(epochs=1, batch_size=8, val_beam_size=1, ema=0.0)
    fit(FitJob(str(data_dir), str(tmp_path / "run"), SMALL, cfg, device="cpu", progress_bar=False))
    assert "training_model" not in load_checkpoint(str(tmp_path / "run" / "last.pt"))


def test_runs_saved_before_the_average_resume_without_it():
    assert TrainConfig().optim.ema > 0  # on for new runs
    saved = {"epochs": 4, "batch_size": 32, "lr": 1e-3}  # a flat config of version 3, from before --ema
    assert TrainConfig.from_dict(current_train(saved)).optim.ema == 0.0
