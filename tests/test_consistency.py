"""Half-turn consistency of attention: the term, the turned features, and fit using them."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from captioner.data.dataset import CaptionData
from captioner.data.images import load_image
from captioner.models.checkpoint import migrate
from captioner.models.decoder import AttentionDecoder, DecoderConfig
from captioner.models.encoder import EncoderSpec, build_encoder
from captioner.objectives.consistency import consistency, half_turn, real_steps, symmetric_cross_entropy
from captioner.objectives.cross_entropy import sequence_terms
from captioner.train.config import TrainConfig
from captioner.train.loop import fit

S = 14


def cell(x: int, y: int) -> torch.Tensor:
    """A map (1, L) on one grid cell."""
    m = torch.full((1, S * S), 1e-9, dtype=torch.float64)
    m[0, y * S + x] = 1.0
    return m / m.sum()


def test_half_turn_is_a_180_degree_rotation_of_the_grid():
    maps = torch.rand(2, 3, 7 * 5)  # any row-major grid, here 7 x 5
    assert torch.equal(half_turn(maps).view(2, 3, 7, 5), torch.rot90(maps.view(2, 3, 7, 5), 2, dims=(2, 3)))


def test_only_a_sharp_map_that_follows_the_content_costs_nothing():
    """An object at (4, 9) is at (9, 4) once the image is turned. Each way a map can fail pays."""
    x, y = 4, 9
    turn = lambda m: half_turn(m)  # noqa: E731
    on_object = symmetric_cross_entropy(turn(cell(x, y)), cell(S - 1 - x, S - 1 - y))
    offset = symmetric_cross_entropy(turn(cell(x, y - 1)), cell(S - 1 - x, S - 1 - y - 1))  # one cell above, both
    parked = symmetric_cross_entropy(turn(cell(0, 0)), cell(0, 0))  # the same corner whatever the image
    even = torch.full((1, S * S), 1.0 / (S * S), dtype=torch.float64)
    pair = (cell(2, 3) + cell(S - 3, S - 4)) / 2  # two cells mirrored through the centre
    assert float(on_object) < 1e-5  # the cells off the object hold 1e-9 each
    assert float(offset) > 5 and float(parked) > 5
    assert float(symmetric_cross_entropy(turn(even), even)) == pytest.approx(math.log(S * S))
    assert float(symmetric_cross_entropy(turn(pair), pair)) == pytest.approx(math.log(2), abs=1e-4)


def test_the_term_is_finite_on_maps_with_zeros():
    a = torch.zeros(2, S * S, requires_grad=True)
    with torch.no_grad():
        a[:, 0] = 1.0  # float32 softmax can underflow to exact zeros
    loss = symmetric_cross_entropy(a, a.detach().flip(-1)).sum()
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(a.grad).all()


def test_it_is_estimated_on_real_steps_of_a_share_of_the_captions(data_dir):
    mask = torch.arange(6).unsqueeze(0) < torch.tensor([[2], [6], [1], [4]])
    g = torch.Generator().manual_seed(0)
    rows = torch.tensor([0, 2, 3])
    for _ in range(20):
        assert mask[rows, real_steps(mask, rows, g)].all()
    data = CaptionData(str(data_dir))
    data.turned_share = 0.25
    for batch in data.batches(16, seed=0, epoch=0):
        assert len(batch.turned_rows) == len(batch.turned) == 4 and len(set(batch.turned_rows.tolist())) == 4
        assert batch.turned.shape[1:] == batch.features.shape[1:]


def test_the_term_uses_the_passs_own_states_and_no_second_pass():
    """α' is the map the same h_{t-1} gives on the turned image, the step's own α turned back."""
    torch.manual_seed(0)
    dec = AttentionDecoder(vocab_size=9, encoder_dim=6, embed_dim=5, hidden_dim=7, attention_dim=4, dropout=0.0)
    dec = dec.double()
    feats, turned = torch.randn(2, 4, 9, 6, dtype=torch.float64)
    captions = torch.tensor([[1, 4, 5, 2], [1, 6, 2, 0], [1, 7, 8, 2], [1, 3, 2, 0]])
    lengths = torch.tensor([4, 3, 4, 3])
    _, _, u, mask = sequence_terms(dec, feats, captions, lengths)
    rows = torch.tensor([0, 1, 3])
    got = consistency(dec, feats, turned[rows], rows, u, mask, mask.sum(), torch.Generator().manual_seed(3))
    steps = real_steps(mask, rows, torch.Generator().manual_seed(3))
    want = []
    for b, t in zip(rows.tolist(), steps.tolist()):
        a = dec.normalize(feats[b : b + 1])
        h, c = dec.init_state(a)
        proj = dec.attention.project(a)
        for s in range(t):  # the plain step, to the picked step
            alpha = dec.attend(proj, h)
            h, c, _ = dec.advance(a, alpha, dec.embedding(captions[b : b + 1, s]), h, c)
        on_image = dec.attend(proj, h)
        on_turned = dec.attend(dec.attention.project(dec.normalize(turned[b : b + 1])), h)
        want.append(symmetric_cross_entropy(half_turn(on_image), on_turned))
    assert float(got.detach()) == pytest.approx(float(torch.cat(want).mean().detach()), rel=1e-6)
    got.backward()
    assert all(p.grad is not None for p in dec.attention.parameters())


def test_prepare_stores_the_features_of_the_turned_images(data_dir, scenes):
    """features_rot180 row r is the encoder's output on image r turned 180° (its file turned by Pillow)."""
    data = CaptionData(str(data_dir))
    assert data.meta["rotated"] is True and data.turned is not None
    encoder, spec = build_encoder(EncoderSpec(weights="none"))
    rows = [0, 5]
    images = torch.stack([spec.preprocess(load_image(data.path_of(r)).rotate(180)) for r in rows])
    with torch.inference_mode():
        want = encoder(images).numpy()  # (2, L, D)
    got = data.turned[rows].astype(np.float32)
    plain = data.cache[rows].astype(np.float32)
    scale = np.abs(want).max()
    # fp16 storage and Pillow's resampling of a turned file against turning the resampled tensor
    assert np.abs(got - want).max() < 0.05 * scale
    assert np.abs(plain - want).max() > 0.2 * scale  # the turned features are not the plain ones


@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_fit_adds_the_term_when_the_data_has_turned_features(data_dir, tmp_path, attention):
    small = DecoderConfig(0, embed_dim=16, hidden_dim=24, attention_dim=12, dropout=0.0, attention=attention)
    for name, weight in (("on", 1.0), ("off", 0.0)):
        cfg = TrainConfig(epochs=1, batch_size=8, val_images=4, log_every=1, consistency=weight)
        fit(str(data_dir), str(tmp_path / name), small, cfg, device="cpu", progress_bar=False)
    rows = {
        name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        for name in ("on", "off")
    }
    on = [r for r in rows["on"] if r["event"] == "train"]
    assert on and all(r["consistency"] > 0 for r in on)
    if attention == "soft":  # hard: the REINFORCE surrogate is no NLL
        assert all(r["loss"] > r["nll"] for r in on)
    assert all("consistency" not in r for r in rows["off"] if r["event"] == "train")


def test_fit_says_when_the_data_has_no_turned_features(scenes, tmp_path, caplog):
    from captioner.train.prepare import PrepareConfig, prepare

    out = tmp_path / "plain"
    prepare(
        PrepareConfig(
            captions=[str(scenes / "captions.json")],
            images=[str(scenes / "images")],
            out=str(out),
            splits=str(scenes / "splits.json"),
            encoder=EncoderSpec(weights="none"),
            min_count=1,
            workers=0,
            rotated=False,
        ),
        progress=False,
    )
    assert CaptionData(str(out)).turned is None
    fit(
        str(out),
        str(tmp_path / "run"),
        DecoderConfig(0, embed_dim=16, hidden_dim=24, attention_dim=12),
        TrainConfig(epochs=1, batch_size=16, val_images=2),
        device="cpu",
        progress_bar=False,
    )
    assert "no features of the images turned 180°" in caplog.text and "prepare again" in caplog.text


@pytest.mark.parametrize("saved", [{}, {"equivariance": 0.5}])
def test_an_older_run_resumes_without_a_term_it_was_not_trained_with(saved):
    """Checkpoints before version 3 knew no consistency term (and the equivariance term is gone)."""
    old = {
        "format": "captioner-checkpoint/2",
        "model": {},
        "decoder": {},
        "vocab": [],
        "encoder": {},
        "step": 1,
        "train": dict(saved),
    }
    cfg = TrainConfig.from_dict(migrate(old, "old.pt")["train"])
    assert cfg.consistency == 0.0 and not hasattr(cfg, "equivariance")
