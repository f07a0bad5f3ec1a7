"""A short training run learns: BLEU-4 and CIDEr well above an untrained model's, on held-out scenes."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import prepare_scenes

from captioner.evaluation.evaluate import evaluate
from captioner.models.decoder import DecoderConfig
from captioner.models.encoder import EncoderSpec
from captioner.scenes.synthetic import generate
from captioner.train.config import TrainConfig
from captioner.train.trainer import FitJob, fit

SMALL = DecoderConfig(0, embed_dim=64, hidden_dim=128, attention_dim=64, dropout=0.1)


@pytest.fixture(scope="module")
def scenes_112(tmp_path_factory):
    """240 scenes encoded at 112×112 (a 7×7 grid): four times cheaper than 224, same pipeline."""
    root = tmp_path_factory.mktemp("learn")
    generate(str(root / "scenes"), 240, seed=5)
    prepare_scenes(root / "scenes", root / "data", encoder=EncoderSpec(weights="none", image_size=112))
    return root / "data"


@pytest.mark.slow
def test_short_training_beats_untrained(scenes_112, tmp_path):
    scores = {}
    for name, cfg in (
        ("trained", TrainConfig.of(epochs=10, lr=2e-3, val_beam_size=1, patience=10)),
        ("untrained", TrainConfig.of(epochs=1, lr=1e-12, val_beam_size=1)),
    ):
        run = tmp_path / name
        fit(FitJob(str(scenes_112), str(run), SMALL, cfg, device="cpu", progress_bar=False))
        scores[name] = evaluate(str(run / "best.pt"), str(scenes_112), "test", str(run / "m.json"), use_java=False)
    trained, untrained = scores["trained"], scores["untrained"]
    assert trained["BLEU-4"] >= untrained["BLEU-4"] + 0.1, scores
    assert trained["CIDEr"] >= untrained["CIDEr"] + 0.4, scores
    log = [json.loads(line) for line in (tmp_path / "trained" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["nll"] for r in log if r["event"] == "train"]
    assert losses[-1] < 0.6 * losses[0]
    assert torch.load(tmp_path / "trained" / "last.pt", weights_only=True)["step"] > 0
