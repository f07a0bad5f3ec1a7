"""`--encoder-weights PATH`: a user's own VGG state dict, checked, refused by name, and carried along.

A file of the wrong architecture, truncated or pickled is refused with a message naming it and
the first wrong key, no traceback, nothing written; a right one prepares the data, and the
checkpoint and the exported folder rebuild exactly its encoder, the exported one without the file.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
import torchvision
from conftest import prepare_scenes
from safetensors.torch import save_file

from captioner import Captioner
from captioner.cli.train import main as train_main
from captioner.errors import CaptionerError
from captioner.models.checkpoint import load_checkpoint
from captioner.models.decoder import DecoderConfig
from captioner.models.encoder import REGENERATED, EncoderSpec, build_encoder, carried_weights
from captioner.scenes.synthetic import generate
from captioner.serve.export import export
from captioner.train.config import TrainConfig
from captioner.train.trainer import FitJob, fit


@pytest.fixture(scope="module")
def vgg16_state():
    """A whole VGG16 features state dict, torchvision's names: the seeded one with conv5_3 changed."""
    enc, _ = build_encoder(EncoderSpec(weights="none", seed=0))
    state = {f"features.{k}": v.clone() for k, v in enc.features.state_dict().items()}
    state["features.28.weight"] *= 0.5  # another encoder than --encoder-weights none
    return state


@pytest.fixture(scope="module")
def tiny_scenes(tmp_path_factory):
    out = tmp_path_factory.mktemp("weights_scenes")
    generate(str(out), 12, seed=23)
    return out


def _vgg19_state():
    with torch.device("meta"):
        trunk = torchvision.models.vgg19(weights=None).features
    return {f"features.{k}": torch.zeros(v.shape) for k, v in trunk.state_dict().items()}


def test_torch_and_safetensors_files_give_the_same_encoder(tmp_path, vgg16_state):
    torch.save(vgg16_state, tmp_path / "vgg.pth")
    save_file(vgg16_state, str(tmp_path / "vgg.safetensors"))
    torch.save({"state_dict": vgg16_state}, tmp_path / "wrapped.pt")  # as some trainers save
    prints = {
        build_encoder(EncoderSpec(weights=str(tmp_path / n)))[1].fingerprint
        for n in ("vgg.pth", "vgg.safetensors", "wrapped.pt")
    }
    assert len(prints) == 1
    assert prints != {build_encoder(EncoderSpec(weights="none"))[1].fingerprint}


@pytest.mark.parametrize(
    "damage", ["vgg19", "resnet", "shape", "truncated", "truncated_safetensors", "pickled", "empty", "not_tensors"]
)
def test_a_wrong_file_is_refused_by_name_and_first_wrong_key(tmp_path, vgg16_state, damage):
    path = tmp_path / ("w.safetensors" if "safetensors" in damage else "w.pth")
    expected = {
        "vgg19": "features.17.weight",  # VGG19's layers sit at other indices: the first VGG16 layer it lacks
        "resnet": "features.0.weight",
        "shape": "features.24.weight",
        "truncated": "truncated",
        "truncated_safetensors": "truncated",
        "pickled": "pickled",
        "empty": "empty",
        "not_tensors": "'note'",
    }[damage]
    if damage == "vgg19":
        torch.save(_vgg19_state(), path)
    elif damage == "resnet":
        torch.save({"conv1.weight": torch.zeros(64, 3, 7, 7), "fc.weight": torch.zeros(10, 512)}, path)
    elif damage == "shape":
        torch.save({**vgg16_state, "features.24.weight": torch.zeros(256, 512, 3, 3)}, path)
    elif damage.startswith("truncated"):
        full = tmp_path / "full"
        save_file(vgg16_state, str(full)) if "safetensors" in damage else torch.save(vgg16_state, full)
        path.write_bytes(full.read_bytes()[: full.stat().st_size // 2])
    elif damage == "pickled":
        torch.save(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3)), path)  # a module, not its state dict
    elif damage == "empty":
        path.write_bytes(b"")
    else:
        torch.save({**vgg16_state, "note": "trained by me"}, path)
    with pytest.raises(CaptionerError) as e:
        build_encoder(EncoderSpec(weights=str(path)))
    assert str(path) in str(e.value) and expected in str(e.value)
    if damage == "vgg19":
        assert "--encoder vgg19" in str(e.value)  # it says which architecture the file fits


def test_a_vgg19_file_with_encoder_vgg19_is_taken(tmp_path):
    torch.save(_vgg19_state(), tmp_path / "vgg19.pth")
    enc, spec = build_encoder(EncoderSpec(arch="vgg19", weights=str(tmp_path / "vgg19.pth")))
    assert spec.fingerprint and len(enc.features) == 36


def test_prepare_refuses_a_wrong_file_without_a_traceback_and_writes_nothing(tmp_path, tiny_scenes, capsys):
    torch.save({"conv1.weight": torch.zeros(64, 3, 7, 7)}, tmp_path / "resnet.pth")
    out = tmp_path / "data"
    args = ["prepare", "--images", str(tiny_scenes / "images"), "--captions", str(tiny_scenes / "captions.json")]
    status = train_main(
        [*args, "--out", str(out), "--encoder-weights", str(tmp_path / "resnet.pth"), "--device", "cpu"]
    )
    err = capsys.readouterr().err
    assert status != 0
    assert str(tmp_path / "resnet.pth") in err and "features.0.weight" in err
    assert "Traceback" not in err
    assert not out.exists()


@pytest.mark.slow
def test_prepare_fit_export_load_rebuild_the_same_encoder(tmp_path, tiny_scenes, vgg16_state):
    weights = tmp_path / "mine.safetensors"
    save_file(vgg16_state, str(weights))
    data, run, folder = tmp_path / "data", tmp_path / "run", tmp_path / "exported"
    prepare_scenes(tiny_scenes, data, encoder=EncoderSpec(weights=str(weights)), min_count=1, views=False)
    spec = json.loads((data / "meta.json").read_text())["encoder"]
    assert (
        spec["weights"] == str(weights)
        and spec["fingerprint"] == build_encoder(EncoderSpec(weights=str(weights)))[1].fingerprint
    )
    fit(
        FitJob(
            str(data),
            str(run),
            DecoderConfig(0, embed_dim=16, hidden_dim=16, attention_dim=8, dropout=0.0),
            TrainConfig.of(epochs=1, batch_size=8, lr=3e-3, val_beam_size=1, consistency=0.0),
            device="cpu",
            progress_bar=False,
        )
    )
    assert load_checkpoint(str(run / "best.pt"))["encoder"]["fingerprint"] == spec["fingerprint"]
    images = [str(p) for p in sorted((tiny_scenes / "images").iterdir())[:3]]
    from_checkpoint = Captioner.load(str(run / "best.pt"), fast=False)  # reads the file
    export(str(run / "best.pt"), str(folder))
    shutil.move(weights, tmp_path / "gone")  # the exported folder carries the weights it needs
    config = json.loads((folder / "config.json").read_text())
    assert config["encoder"]["weights"] == "mine.safetensors"  # the base name only: no path of this machine
    from_folder = Captioner.load(str(folder), fast=False)
    a, _ = from_checkpoint.encode(images)
    b, _ = from_folder.encode(images)
    assert torch.equal(a, b)
    for x, y in zip(from_checkpoint.caption_batch(images, beam_size=2), from_folder.caption_batch(images, beam_size=2)):
        assert x.words == y.words
        np.testing.assert_allclose(x.attention, y.attention, atol=1e-6)
    with pytest.raises(CaptionerError, match="mine.safetensors"):  # the checkpoint itself needs its file
        Captioner.load(str(run / "best.pt"))


def test_layers_left_at_their_seeded_values_are_not_carried_but_drawn_again(tmp_path, vgg16_state, monkeypatch):
    """A model carries only the layers its file changed (the demo model: conv5); the rest are drawn
    again from their seed at load, checked by the encoder's fingerprint, from a copy after the first time."""
    monkeypatch.setattr(torch.hub, "_hub_dir", str(tmp_path / "hub"))
    half = {k: v.half() for k, v in vgg16_state.items()}  # as the demo's pretraining saves its file
    save_file(half, str(tmp_path / "mine.safetensors"))
    spec = build_encoder(EncoderSpec(weights=str(tmp_path / "mine.safetensors")))[1]
    carried = carried_weights(spec)
    assert sorted(k for k in carried if k != REGENERATED) == ["28.weight"]  # its bias is still the seeded zeros
    assert carried[REGENERATED].tolist() == [0, 16]
    assert build_encoder(spec, carried)[1].fingerprint == spec.fingerprint
    (copy,) = (tmp_path / "hub" / "captioner").iterdir()
    save_file({"0.weight": torch.zeros(64, 3, 3, 3)}, str(copy))  # a damaged copy: drawn again
    assert build_encoder(spec, carried)[1].fingerprint == spec.fingerprint
    other = {**carried, REGENERATED: torch.tensor([1, 16])}  # drawn otherwise than the file was made
    with pytest.raises(CaptionerError, match=r"RandomState\(1\)"):
        build_encoder(spec, other)
