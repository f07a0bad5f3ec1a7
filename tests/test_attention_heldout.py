"""Attention at the defaults looks at the objects on scenes of the held-out generator.

A short training on `tools.heldout` scenes: 1,200 scenes at 112×112 (a 7×7 grid), three
epochs of the default decoder. Trained on captions alone, soft attention parked on the grid's
border cells on such scenes, whatever the word; the test guards that the defaults keep it on the
objects and off the border. Pointing is noisy at this budget, hence the fixed data seed and a bar
of twice chance; docs/results.md ("The test suite's budget") has the figures measured on it.
"""

from __future__ import annotations

import json

import pytest
from conftest import prepare_scenes

from captioner.evaluation.evaluate import evaluate
from captioner.models.decoder import DecoderConfig
from captioner.models.encoder import EncoderSpec
from captioner.train.config import TrainConfig
from captioner.train.trainer import FitJob, fit
from tools.heldout import generate


@pytest.fixture(scope="module")
def heldout_112(tmp_path_factory):
    root = tmp_path_factory.mktemp("heldout_train")
    generate(root / "scenes", 1200, seed=1)
    prepare_scenes(root / "scenes", root / "data", encoder=EncoderSpec(weights="none", image_size=112))
    return root


@pytest.mark.slow
def test_defaults_point_at_objects_not_the_border(heldout_112, tmp_path):
    data, run = heldout_112 / "data", tmp_path / "run"
    fit(
        FitJob(
            str(data),
            str(run),
            DecoderConfig(0),
            TrainConfig.of(epochs=3, val_beam_size=1),
            device="cpu",
            progress_bar=False,
        )
    )
    log = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("consistency", 0) > 0 for r in log if r["event"] == "train"), "the term was not on"
    m = evaluate(
        str(run / "best.pt"),
        str(data),
        "test",
        str(run / "m.json"),
        use_java=False,
        grounding=str(heldout_112 / "scenes" / "boxes.json"),
    )
    health, g = m["attention_health"], m["grounding"]
    assert json.loads((run / "m.json").read_text())["attention_health"] == health
    assert health["border"] < 0.5, health  # not parked on the grid's edge
    assert g["pointing"] >= 2 * g["chance"], g  # on the named object, well above chance
