"""Attention health: the figures tell maps that follow objects from parked and spread ones."""

import numpy as np
import pytest

from captioner.evaluation.metrics import attention_health, health_summary, problems

G = 14


def _peaked(cells, sharpness=8.0):
    """One map per (row, col): a bump on that cell, softmax-normalised, (n, G, G)."""
    yy, xx = np.mgrid[:G, :G]
    maps = []
    for r, c in cells:
        logits = -sharpness * ((yy - r) ** 2 + (xx - c) ** 2) / G
        m = np.exp(logits - logits.max())
        maps.append(m / m.sum())
    return np.stack(maps)


def _object_following(n_captions=60, seed=0):
    rng = np.random.default_rng(seed)
    captions = []
    for _ in range(n_captions):
        objects = [tuple(rng.integers(1, G - 1, size=2)) for _ in range(rng.integers(1, 3))]
        words = [objects[rng.integers(len(objects))] for _ in range(6)]
        captions.append(_peaked(words))
    return captions


def test_maps_that_follow_objects_are_healthy():
    health = attention_health(_object_following())
    assert problems(health) == []
    assert health["border"] < 1.0 and health["top5"] < 0.2
    assert health_summary(health).endswith("- ok")


def test_parked_on_a_corner_is_flagged():
    rng = np.random.default_rng(1)
    captions = []
    for _ in range(60):
        corner = [(0, 0)] * 5 + [tuple(rng.integers(1, G - 1, size=2))]  # a word or two elsewhere
        captions.append(_peaked(corner))
    health = attention_health(captions)
    found = problems(health)
    assert any("border" in p for p in found) and any("five cells" in p for p in found)
    assert "NOT MEANINGFUL" in health_summary(health)


def test_even_maps_are_flagged_and_no_words_is_not_judged():
    even = [np.full((5, G, G), 1.0 / (G * G)) + np.random.default_rng(i).random((5, G, G)) * 1e-6 for i in range(10)]
    health = attention_health([m / m.sum(axis=(1, 2), keepdims=True) for m in even])
    assert health["entropy"] > 0.99
    assert any("evenly" in p for p in problems(health))
    empty = attention_health([np.zeros((0, G, G))])
    assert empty["words"] == 0 and problems(empty) == []


@pytest.mark.parametrize("entropy, flagged", [(0.78, False), (0.87, False), (0.90, True), (0.92, True)])
def test_entropy_warns_where_the_paper_objectives_maps_sit_and_not_below(entropy, flagged):
    assert any("evenly" in p for p in problems({**HEALTHY, "entropy": entropy})) == flagged


@pytest.mark.parametrize("shape", [(4, G, G), (4, G * G)])
def test_accepts_grids_and_flat_maps(shape):
    maps = _peaked([(3, 4), (3, 4), (9, 9), (9, 9)]).reshape(shape)
    health = attention_health([maps])
    assert health["words"] == 4 and health["stay"] == 0.5


HEALTHY = {"entropy": 0.5, "stay": 0.6, "border": 0.3, "top5": 0.1, "words": 100, "captions": 20}
PARKED = {**HEALTHY, "top5": 0.9}


def test_best_is_the_best_scoring_validation_whose_health_is_ok():
    from captioner.train.checkpoints import select
    from captioner.train.config import Progress

    logged, progress = [], Progress()
    log = type("Log", (), {"write": lambda _, record: logged.append(record), "main": True})()
    chosen = [
        select(
            progress,
            {"CIDEr": c, "BLEU-4": 0.1, "example": "", "attention_health": h},
            "CIDEr",
            log=log,
            lr=1e-3,
            boxed=False,
        )
        for c, h in ((1.0, PARKED), (0.8, HEALTHY), (1.5, PARKED), (0.9, HEALTHY), (0.85, HEALTHY))
    ]
    # a healthy one replaces a flagged best.pt whatever its score; a flagged one never replaces a healthy one
    assert chosen == [True, True, False, True, False]
    assert progress.best == 0.9 and progress.best_healthy and progress.stale == 1
    assert len(logged) == 5


@pytest.mark.slow
def test_a_model_whose_maps_were_flagged_says_so_wherever_it_shows_them(small_run, scenes, tmp_path):
    from conftest import run_cli

    from captioner import Captioner
    from captioner.demo.card import model_notice
    from captioner.models.checkpoint import load_checkpoint, save_checkpoint

    ck = load_checkpoint(str(small_run / "best.pt"))
    assert ck["attention"] is not None and "meaningful" in ck["attention"]  # fit records its verdict
    ck["attention"] = {"meaningful": False, "problems": problems(PARKED), "health": PARKED}
    save_checkpoint(ck, str(tmp_path / "flagged.pt"))
    cap = Captioner.load(str(tmp_path / "flagged.pt"))
    assert "not meaningful" in cap.attention_warning and "same five cells" in cap.attention_warning
    assert cap.attention_warning in model_notice(cap)
    image = str(sorted((scenes / "images").iterdir())[0])
    p = run_cli(
        "-m",
        "captioner",
        "caption",
        image,
        "--checkpoint",
        str(tmp_path / "flagged.pt"),
        "--figures",
        str(tmp_path / "figs"),
        "--device",
        "cpu",
    )
    assert p.returncode == 0 and "warning: This model's attention maps are not meaningful" in p.stderr, p.stderr
    ck["attention"] = {"meaningful": True, "problems": [], "health": HEALTHY}
    save_checkpoint(ck, str(tmp_path / "ok.pt"))
    assert Captioner.load(str(tmp_path / "ok.pt")).attention_warning is None


def test_the_advice_suggests_boxes_only_to_runs_without_them():
    from captioner.evaluation.metrics import advice

    assert "`fit --boxes`" in advice(boxes=False)
    assert "`fit --boxes`" not in advice(boxes=True) and "--alpha-c" in advice(boxes=True)
