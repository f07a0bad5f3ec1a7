"""Half-turn equivariance of soft attention (issue 10): the term, the turned features, and fit using them."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from captioner.data.dataset import CaptionData
from captioner.data.images import load_image
from captioner.models.checkpoint import migrate
from captioner.models.decoder import AttentionDecoder, DecoderConfig
from captioner.models.encoder import EncoderSpec, build_encoder
from captioner.objectives.equivariance import equivariance_loss, half_turn
from captioner.objectives.reinforce import HardAttentionConfig, hard_attention_loss
from captioner.train.config import TrainConfig
from captioner.train.loop import fit

S = 14


def bump(x: float, y: float, side: int = S) -> torch.Tensor:
    """A peaked map (L,) centred at grid position (x, y)."""
    gy, gx = torch.meshgrid(
        torch.arange(side, dtype=torch.float64), torch.arange(side, dtype=torch.float64), indexing="ij"
    )
    m = torch.exp(-((gx - x) ** 2 + (gy - y) ** 2) / 1.0)
    return (m / m.sum()).flatten()


def test_half_turn_is_a_180_degree_rotation_of_the_grid():
    maps = torch.rand(2, 3, 7 * 5)  # any row-major grid, here 7 x 5
    assert torch.equal(half_turn(maps).view(2, 3, 7, 5), torch.rot90(maps.view(2, 3, 7, 5), 2, dims=(2, 3)))


def test_attending_the_object_costs_nothing_and_a_fixed_offset_does():
    """An object at (4, 9) is at (9, 4) once the image is turned. Looking at it in both is
    equivariant; looking one cell above it in both (a learned offset) is not."""
    (x, y), (rx, ry) = (4.0, 9.0), (S - 1 - 4.0, S - 1 - 9.0)
    mask = torch.ones(1, 1)
    on_object = equivariance_loss(bump(x, y).view(1, 1, -1), bump(rx, ry).view(1, 1, -1), mask)
    above = equivariance_loss(bump(x, y - 1).view(1, 1, -1), bump(rx, ry - 1).view(1, 1, -1), mask)
    assert float(on_object) < 1e-6
    assert float(above) > 0.5  # at most 2 (disjoint maps)
    # padding steps do not count
    assert (
        float(equivariance_loss(bump(x, y - 1).view(1, 1, -1), bump(rx, ry - 1).view(1, 1, -1), torch.zeros(1, 1))) == 0
    )


def test_the_term_is_finite_on_maps_with_zeros():
    a = torch.zeros(1, 2, S * S, requires_grad=True)
    with torch.no_grad():
        a[0, :, 0] = 1.0  # float32 softmax can underflow to exact zeros
    loss = equivariance_loss(a, a.detach().flip(-1), torch.ones(1, 2))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(a.grad).all()


def test_hard_attention_charges_the_term_on_its_expected_context_captions_only():
    """Sampled captions' maps follow a random trajectory, so only the captions trained on the
    expected context (the authors' semi-sampling half) are compared with their turned image's."""
    torch.manual_seed(0)
    dec = AttentionDecoder(
        vocab_size=9, encoder_dim=6, embed_dim=5, hidden_dim=7, attention_dim=4, dropout=0.0, attention="hard"
    ).double()
    feats, turned = torch.randn(2, 4, 9, 6, dtype=torch.float64)
    captions = torch.tensor([[1, 4, 5, 2], [1, 6, 2, 0], [1, 7, 8, 2], [1, 3, 2, 0]])
    lengths = torch.tensor([4, 3, 4, 3])

    def term(semi):
        _, terms = hard_attention_loss(
            dec,
            feats,
            captions,
            lengths,
            baseline=0.0,
            cfg=HardAttentionConfig(semi_sampling=semi),
            alpha_c=0.0,
            generator=torch.Generator().manual_seed(1),
            rotated=turned,
            equivariance=1.0,
        )
        return float(terms["equivariance"])

    mask = torch.arange(3).unsqueeze(0) < (lengths - 1).unsqueeze(1)
    with torch.no_grad():
        want = (
            equivariance_loss(
                dec.unroll(feats, captions).alphas, dec.unroll(turned, captions).alphas, mask.double()
            ).sum()
            / mask.sum()
        )
    assert term(1.0) == pytest.approx(float(want), rel=1e-6) and float(want) > 0  # every caption expected
    assert term(0.0) == 0.0  # every caption sampled
    _, terms = hard_attention_loss(
        dec,
        feats,
        captions,
        lengths,
        baseline=0.0,
        cfg=HardAttentionConfig(),
        alpha_c=0.0,
        rotated=turned,
        equivariance=0.0,
    )
    assert "equivariance" not in terms


def test_prepare_stores_the_features_of_the_turned_images(data_dir, scenes):
    """features_rot180 row r is the encoder's output on image r turned 180° (its file turned by Pillow)."""
    data = CaptionData(str(data_dir))
    assert data.meta["rotated"] is True and data.rotated is not None
    encoder, spec = build_encoder(EncoderSpec(weights="none"))
    rows = [0, 5]
    images = torch.stack([spec.preprocess(load_image(data.path_of(r)).rotate(180)) for r in rows])
    with torch.inference_mode():
        want = encoder(images).numpy()  # (2, L, D)
    got = data.rotated[rows].astype(np.float32)
    plain = data.cache[rows].astype(np.float32)
    scale = np.abs(want).max()
    # fp16 storage and Pillow's resampling of a turned file against turning the resampled tensor
    assert np.abs(got - want).max() < 0.05 * scale
    assert np.abs(plain - want).max() > 0.2 * scale  # the turned features are not the plain ones


@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_fit_adds_the_term_when_the_data_has_turned_features(data_dir, tmp_path, attention):
    small = DecoderConfig(0, embed_dim=16, hidden_dim=24, attention_dim=12, dropout=0.0, attention=attention)
    fit(
        str(data_dir),
        str(tmp_path / "on"),
        small,
        TrainConfig(epochs=1, batch_size=8, val_images=4, log_every=1),
        device="cpu",
        progress_bar=False,
    )
    fit(
        str(data_dir),
        str(tmp_path / "off"),
        small,
        TrainConfig(epochs=1, batch_size=8, val_images=4, log_every=1, equivariance=0.0),
        device="cpu",
        progress_bar=False,
    )
    rows = {
        name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        for name in ("on", "off")
    }
    on = [r for r in rows["on"] if r["event"] == "train"]
    assert on and all(r["equivariance"] > 0 for r in on)
    if attention == "soft":  # hard: the REINFORCE surrogate is no NLL
        assert all(r["loss"] > r["nll"] for r in on)
    assert all("equivariance" not in r for r in rows["off"] if r["event"] == "train")


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
    assert CaptionData(str(out)).rotated is None
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
def test_resume_keeps_the_objective_a_run_was_trained_with(saved):
    """Runs saved before the term existed (format version 1) resume without it."""
    old = {
        "format": "captioner-checkpoint/1",
        "model": {},
        "decoder": {},
        "vocab": [],
        "encoder": {},
        "step": 1,
        "train": dict(saved),
    }
    assert TrainConfig.from_dict(migrate(old, "old.pt")["train"]).equivariance == saved.get("equivariance", 0.0)
