"""The encoder: seeded reproducibility, fingerprints, weight sources, preprocessing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torchvision
from PIL import Image

from captioner.errors import CaptionerError
from captioner.models.encoder import EncoderSpec, build_encoder
from captioner.models.preprocess import IMAGENET_STD, Preprocess

# The seeded random VGG16 must be the same network on every machine and library release:
# its weights come from NumPy's frozen legacy RandomState. A change here breaks every
# feature cache and checkpoint made with --encoder-weights none.
VGG16_SEED0_FINGERPRINT = "e6f4db1b017eca4c"


@pytest.fixture(scope="module")
def vgg16():
    return build_encoder(EncoderSpec(weights="none", seed=0))


def test_seeded_encoder_is_reproducible(vgg16):
    enc, spec = vgg16
    assert spec.fingerprint == VGG16_SEED0_FINGERPRINT
    again, spec2 = build_encoder(EncoderSpec(weights="none", seed=0))
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        f1, f2 = enc(x), again(x)
    assert f1.shape == (2, 196, 512)
    assert torch.equal(f1, f2)
    assert (f1 >= 0).all()  # conv5_3 after its ReLU


def test_other_seed_other_encoder_and_mismatch_is_refused(vgg16):
    _, spec = build_encoder(EncoderSpec(weights="none", seed=1))
    assert spec.fingerprint != VGG16_SEED0_FINGERPRINT
    with pytest.raises(CaptionerError, match="fingerprint"):
        build_encoder(EncoderSpec(weights="none", seed=1, fingerprint=VGG16_SEED0_FINGERPRINT))


def test_vgg19_depth():
    enc, spec = build_encoder(EncoderSpec(arch="vgg19", weights="none"))
    assert len(enc.features) == 36
    assert enc(torch.zeros(1, 3, 224, 224)).shape == (1, 196, 512)


def test_state_dict_path(tmp_path, vgg16):
    enc, spec = vgg16
    full = {f"features.{k}": v for k, v in enc.features.state_dict().items()}
    full["classifier.0.weight"] = torch.zeros(2, 2)  # a whole VGG state dict is accepted
    path = tmp_path / "vgg.pth"
    torch.save(full, path)
    _, spec2 = build_encoder(EncoderSpec(weights=str(path)))
    assert spec2.fingerprint == spec.fingerprint
    torch.save({"0.weight": torch.zeros(3)}, tmp_path / "bad.pth")
    with pytest.raises(CaptionerError, match="bad.pth"):
        build_encoder(EncoderSpec(weights=str(tmp_path / "bad.pth")))
    with pytest.raises(CaptionerError, match="no such file"):
        build_encoder(EncoderSpec(weights=str(tmp_path / "missing.pth")))


def test_imagenet_offline_says_where_to_put_the_file(monkeypatch, tmp_path):
    old = torch.hub.get_dir()
    torch.hub.set_dir(str(tmp_path / "hub"))

    def offline(self, *a, **k):
        raise OSError("<urlopen error [Errno -3] Temporary failure in name resolution>")

    monkeypatch.setattr(torchvision.models.WeightsEnum, "get_state_dict", offline)
    try:
        with pytest.raises(CaptionerError) as e:
            build_encoder(EncoderSpec(weights="imagenet"))
    finally:
        torch.hub.set_dir(old)
    msg = str(e.value)
    assert "vgg16-397923af.pth" in msg and str(tmp_path / "hub" / "checkpoints") in msg
    assert "--encoder-weights" in msg


def test_preprocess_shapes_and_grid_box():
    from PIL import Image

    img = Image.new("RGB", (320, 96), (255, 0, 0))
    for crop in (False, True):
        x = Preprocess(crop=crop)(img)
        assert x.shape == (3, 224, 224)
    assert Preprocess().grid_box(320, 96) == (0, 0, 320, 96)
    l, t, r, b = Preprocess(crop=True).grid_box(320, 96)
    assert r - l == pytest.approx(b - t) and t == pytest.approx((96 - (b - t)) / 2)
    assert b - t == pytest.approx(96 * 224 / 256)


@pytest.mark.parametrize("crop", [False, True])
@pytest.mark.parametrize("size", [(640, 480), (97, 301), (224, 224)])
def test_resizing_where_the_pixels_are_matches_pillows(crop, size):
    """The API's preprocessing on a GPU (`Preprocess.pixels`, the resize done by PyTorch) gives the
    inputs Pillow's gives `prepare`, to within Pillow's rounding between its passes."""
    rs = np.random.RandomState(3)
    small = (rs.rand(size[1] // 8 + 1, size[0] // 8 + 1, 3) * 255).astype(np.uint8)
    img = Image.fromarray(small).resize(size, Image.BICUBIC)  # a photo's smooth gradients and edges
    pre = Preprocess(crop=crop)
    pillow, torch_ = pre(img), pre.pixels(torch.from_numpy(np.array(img)))
    assert torch_.shape == pillow.shape == (3, 224, 224) and torch_.dtype == torch.float32
    grey_levels = ((torch_ - pillow) * torch.tensor(IMAGENET_STD).view(3, 1, 1) * 255).abs()
    assert grey_levels.max() <= 1.01 and grey_levels.mean() < 0.35  # uniform rounding: 0.25 on average


def test_resizing_a_batch_where_the_pixels_are_resizes_each_image_alike():
    rs = np.random.RandomState(4)
    images = torch.from_numpy((rs.rand(3, 61, 83, 3) * 255).astype(np.uint8))  # (B, H, W, 3)
    for crop in (False, True):
        pre = Preprocess(crop=crop)
        batch = pre.pixels(images)  # (B, 3, S, S)
        assert batch.shape == (3, 3, 224, 224)
        for x, one in zip(batch, images):
            torch.testing.assert_close(x, pre.pixels(one))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_apis_inputs_on_a_gpu_are_each_images_own_whatever_the_sizes_mixed():
    """On a GPU the API copies the images of one size together: each row is still its own image's, in order."""
    from captioner import Captioner
    from captioner.serve.sources import demo_model

    rs = np.random.RandomState(5)
    images = [(rs.rand(h, w, 3) * 255).astype(np.uint8) for h, w in ((48, 64), (64, 48), (48, 64), (30, 30))]
    cap = Captioner.load(demo_model(), device="cuda")
    x, sizes = cap._inputs(images)  # (B, 3, S, S)
    assert sizes == [(64, 48), (48, 64), (64, 48), (30, 30)]
    pre = cap.encoder_spec.preprocess
    for row, im in zip(x, images):
        torch.testing.assert_close(row.cpu(), pre.pixels(torch.from_numpy(im)), atol=1e-4, rtol=1e-4)


def test_the_encoder_is_imagenets_wherever_it_is_not_chosen():
    """The Python API, `prepare`'s config and its command line agree: random weights only when asked."""
    from captioner.cli.train import get_parser
    from captioner.options import from_args
    from captioner.train.prepare import PrepareConfig

    assert EncoderSpec().weights == "imagenet"
    assert PrepareConfig(images=["i"], out="o", captions=["c.json"]).encoder.weights == "imagenet"
    args = get_parser().parse_args(["prepare", "--images", "i", "--out", "o", "--captions", "c.json"])
    assert from_args(PrepareConfig, args).encoder == EncoderSpec()
    args = get_parser().parse_args(
        ["prepare", "--images", "i", "--out", "o", "--captions", "c.json", "--encoder-weights", "none"]
    )
    assert from_args(PrepareConfig, args).encoder.weights == "none"
