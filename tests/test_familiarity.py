"""The "unlike the training images" signal: statistics written by fit, scores and verdicts at inference."""

from __future__ import annotations

import os
import sys

import gradio
import numpy as np
import pytest
import torch

from captioner import Captioner
from captioner.data.dataset import CaptionData
from captioner.demo.views import caption_data
from captioner.evaluation import familiarity as familiarity_module
from captioner.evaluation.familiarity import (
    METHOD,
    FamiliarityStats,
    calibration_photos,
    familiarity,
    fit_stats,
    gaussian,
    mahalanobis,
    threshold,
)
from captioner.models.checkpoint import load_checkpoint, save_checkpoint

# A real photograph the threshold was not set with (calibration uses matplotlib's).
PHOTO = os.path.join(os.path.dirname(gradio.__file__), "media_assets", "images", "lion.jpg")


@pytest.fixture(scope="module")
def captioner(small_run) -> Captioner:
    return Captioner.load(str(small_run / "best.pt"))


def test_fit_stores_plain_statistics_in_the_checkpoint(small_run):
    ck = torch.load(small_run / "best.pt", weights_only=True)  # plain tensors and numbers only
    stats = ck["familiarity"]
    assert stats["method"] == METHOD and stats["train_images"] > 0 and stats["val_images"] > 0
    assert all(stats[k].shape == (512,) for k in ("feature_mean", "feature_std", "pooled_mean"))
    assert stats["precision"].shape == (512, 512) and 0 < stats["shrinkage"] <= 1
    # Calibrated on both sides: at least the validation bound, halfway to the photographs when all lie above it.
    bound = stats["margin"] * stats["val_quantile"]
    assert stats["photo_scores"] and all(
        name.split(":")[0] in {os.path.basename(p) for p in calibration_photos()} for name in stats["photo_scores"]
    )
    assert stats["threshold"] == pytest.approx(threshold(bound, stats["photo_scores"])) and stats["threshold"] >= bound


def test_fit_reads_the_photographs_as_prepare_encoded_them_with_no_encoder_of_its_own(data_dir, monkeypatch):
    data = CaptionData(str(data_dir))

    def no_encoder(*args, **kwargs):
        raise AssertionError("fit built an encoder")

    monkeypatch.setattr(familiarity_module, "build_encoder", no_encoder)
    stored = fit_stats(data).photo_scores
    assert len(stored) == 6 * len(calibration_photos())
    monkeypatch.undo()
    # A directory prepared before prepare stored them: fit encodes them itself, as prepare did.
    monkeypatch.setattr(familiarity_module, "PHOTOS", "absent.npz")
    assert fit_stats(data).photo_scores == pytest.approx(stored, rel=1e-5)


def test_the_threshold_lies_between_scenes_and_photographs_unless_they_overlap():
    assert threshold(2.0, {"a": 8.0, "b": 9.0}) == pytest.approx(4.0)  # geometric mean with the lowest
    assert threshold(2.0, {"a": 1.5, "b": 9.0}) == 2.0  # overlap: the scenes' bound wins
    assert threshold(2.0, {}) == 2.0


def test_the_full_covariance_sees_what_the_channels_alone_do_not():
    g = torch.Generator().manual_seed(0)
    N, D = 4000, 16
    common = torch.randn(N, 1, generator=g)
    # The first 8 channels move together (one factor plus a little noise), the rest are independent.
    x = torch.cat([common + 0.1 * torch.randn(N, 8, generator=g), torch.randn(N, 8, generator=g)], 1)  # (N, D)
    mu, precision, _ = gaussian(x, shrinkage=0.0)
    assert mahalanobis(x, mu, precision).pow(2).mean().item() == pytest.approx(1.0, rel=1e-3)
    along, against = torch.zeros(1, D), torch.zeros(1, D)
    along[0, :8] = 1.0  # all 8 together: one standard deviation of the factor
    against[0, 0], against[0, 1] = 1.0, -1.0  # two of them apart: never seen, though nearer in every channel
    assert mahalanobis(against, mu, precision) > 5 * mahalanobis(along, mu, precision)
    # Few vectors: Ledoit-Wolf shrinks towards the identity (0.31 here); many: hardly at all.
    few, many = gaussian(x[:10])[2], gaussian(x)[2]
    assert few > 0.2 and many < 0.05 and few > 5 * many


def test_held_out_scenes_are_familiar_and_a_photograph_is_not(captioner, data_dir):
    data = CaptionData(str(data_dir))
    _, rows = data.split_images("test")  # never trained on, never calibrated on
    outs = captioner.caption_batch([data.path_of(int(r)) for r in rows], beam_size=1, max_len=4)
    assert all(o.familiarity is not None for o in outs)
    assert sum(o.familiarity["unfamiliar"] for o in outs) <= len(outs) // 4
    photo = captioner.caption(PHOTO, beam_size=1, max_len=4).familiarity
    assert photo["unfamiliar"] and photo["score"] > photo["threshold"] > 0
    assert "unlike the images the model was trained on" in photo["message"]
    assert caption_data(captioner.caption(PHOTO, beam_size=1, max_len=4))["familiarity"] == photo


def test_a_checkpoint_without_statistics_reports_nothing(small_run, tmp_path):
    ck = load_checkpoint(str(small_run / "best.pt"))
    del ck["familiarity"]
    save_checkpoint({k: v for k, v in ck.items() if k != "format"}, str(tmp_path / "old.pt"))
    out = Captioner.load(str(tmp_path / "old.pt")).caption(PHOTO, beam_size=1, max_len=3)
    assert out.familiarity is None and out.text


def test_verdicts_follow_the_threshold():
    d = 8
    stats = FamiliarityStats(torch.zeros(d), torch.ones(d), torch.zeros(d), torch.eye(d), threshold=2.0)
    features = torch.zeros(3, 5, d)  # (B, L, D)
    features[1] += 1.5  # every channel 1.5σ off: score 1.5
    features[2] += 3.0
    verdicts = familiarity(features, stats)
    assert [v["unfamiliar"] for v in verdicts] == [False, False, True]
    assert np.allclose([v["score"] for v in verdicts], [0.0, 1.5, 3.0])
    assert familiarity(features, None) == [None, None, None]
    assert FamiliarityStats.from_dict(stats.to_dict()).threshold == 2.0 and FamiliarityStats.from_dict(None) is None


def test_calibration_uses_only_what_the_dependencies_guarantee(tmp_path, monkeypatch):
    """The same run stores the same threshold on every machine: an optional package that ships
    photographs (scikit-image) does not join the calibration when it happens to be installed."""
    fake = tmp_path / "skimage"
    (fake / "data").mkdir(parents=True)
    for name in ("astronaut.png", "coffee.png", "chelsea.png", "rocket.jpg", "motorcycle_left.png"):
        (fake / "data" / name).write_bytes(b"")
    (fake / "__init__.py").write_text("")
    (fake / "data" / "__init__.py").write_text("")
    before = calibration_photos()
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "skimage" or m.startswith("skimage.")]:
        monkeypatch.delitem(sys.modules, name)
    assert calibration_photos() == before
    assert [os.path.basename(p) for p in before] == ["grace_hopper.jpg"]


def test_training_images_all_alike_still_give_statistics():
    picture = torch.rand(1, 512, generator=torch.Generator().manual_seed(0))
    same = picture.expand(38, 512).contiguous()  # every image the same picture: no covariance to estimate
    mu, precision, shrinkage = gaussian(same)
    assert shrinkage == 1.0 and torch.isfinite(precision).all()
    assert mahalanobis(same[:1], mu, precision).item() < 1e-3
