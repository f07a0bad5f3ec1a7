"""A short training run learns: BLEU-4 well above an untrained model's, on held-out scenes."""
from __future__ import annotations

import json

import torch

from captioner.decoder import DecoderConfig
from captioner.evaluation import evaluate
from captioner.training import TrainConfig, fit


def test_short_training_beats_untrained(data_dir, tmp_path):
    model = DecoderConfig(0, embed_dim=64, hidden_dim=128, attention_dim=64, dropout=0.1)
    trained = tmp_path / "trained"
    fit(str(data_dir), str(trained), model, TrainConfig(epochs=25, batch_size=16, lr=3e-3, patience=25,
                                                        val_beam_size=1), device="cpu", progress_bar=False)
    untrained = tmp_path / "untrained"
    fit(str(data_dir), str(untrained), model, TrainConfig(epochs=1, batch_size=16, lr=1e-12, val_beam_size=1),
        device="cpu", progress_bar=False)
    scores = {}
    for name, run in (("trained", trained), ("untrained", untrained)):
        m = evaluate(str(run / "best.pt"), str(data_dir), "test", str(run / "m.json"), beam_size=3, use_java=False)
        scores[name] = m
    assert scores["trained"]["BLEU-4"] >= scores["untrained"]["BLEU-4"] + 0.2, scores
    assert scores["trained"]["CIDEr"] >= scores["untrained"]["CIDEr"] + 0.5, scores
    log = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    losses = [r["nll"] for r in log if r["event"] == "train"]
    assert losses[-1] < 0.6 * losses[0]
    assert torch.load(trained / "last.pt", weights_only=True)["step"] > 0
