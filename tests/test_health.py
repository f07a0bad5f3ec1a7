"""Attention health: the figures tell maps that follow objects from parked and spread ones."""

import numpy as np
import pytest

from captioner.evaluation.health import attention_health, problems, summary

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
    assert summary(health).endswith("- ok")


def test_parked_on_a_corner_is_flagged():
    rng = np.random.default_rng(1)
    captions = []
    for _ in range(60):
        corner = [(0, 0)] * 5 + [tuple(rng.integers(1, G - 1, size=2))]  # a word or two elsewhere
        captions.append(_peaked(corner))
    health = attention_health(captions)
    found = problems(health)
    assert any("border" in p for p in found) and any("five cells" in p for p in found)
    assert "NOT MEANINGFUL" in summary(health)


def test_even_maps_are_flagged_and_no_words_is_not_judged():
    even = [np.full((5, G, G), 1.0 / (G * G)) + np.random.default_rng(i).random((5, G, G)) * 1e-6 for i in range(10)]
    health = attention_health([m / m.sum(axis=(1, 2), keepdims=True) for m in even])
    assert health["entropy"] > 0.99
    assert any("evenly" in p for p in problems(health))
    empty = attention_health([np.zeros((0, G, G))])
    assert empty["words"] == 0 and problems(empty) == []


@pytest.mark.parametrize("shape", [(4, G, G), (4, G * G)])
def test_accepts_grids_and_flat_maps(shape):
    maps = _peaked([(3, 4), (3, 4), (9, 9), (9, 9)]).reshape(shape)
    health = attention_health([maps])
    assert health["words"] == 4 and health["stay"] == 0.5
