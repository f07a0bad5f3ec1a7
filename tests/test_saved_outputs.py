"""Saved models write what they wrote when they were saved: the guard of every change to the decoder,
the search and the loading code.

The bundled model's card records, for each bundled example, the caption, its score and every word's map
as the page captions it (`demo.examples.record_outputs`). Here the bundled model, and a checkpoint of
every layout `models.checkpoint` migrates (tests/test_checkpoint_versions.py writes them out), caption the
examples again. Versions 1 and 2 predate the word query, so their checkpoint is the bundled model without
it (its W_y dropped, maps as trained): what that model wrote is recorded in saved_outputs.json beside this
file. A change meant to move these outputs records them again: `python -m captioner.demo.examples` for the
card, `python tests/test_saved_outputs.py` for the file; say why in the commit.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from captioner import Captioner
from captioner.demo.examples import example_outputs
from captioner.models.checkpoint import load_checkpoint
from captioner.serve.sources import demo_model, example_images

sys.path.insert(0, os.path.dirname(__file__))
from test_checkpoint_versions import older  # noqa: E402

EARLY = os.path.join(os.path.dirname(__file__), "saved_outputs.json")  # the model without the word query


def card_examples() -> list[dict]:
    with open(os.path.join(demo_model(), "config.json"), encoding="utf-8") as f:
        return json.load(f)["card"]["examples"]


def as_checkpoint(folder: str, path: str) -> dict:
    """The bundled exported model as the version-5 checkpoint it was exported from, loaded (so migrated)."""
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    with open(os.path.join(folder, "vocab.json"), encoding="utf-8") as f:
        vocab = json.load(f)["words"]
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    part = lambda prefix: {k[len(prefix) :]: v.float() for k, v in tensors.items() if k.startswith(prefix)}
    familiarity = {**config["familiarity"], **part("familiarity.")}
    ck = {
        "format": "captioner-checkpoint/5",
        **{k: config[k] for k in ("decoder", "encoder", "max_len", "step", "metrics", "attention", "card")},
        "model": {k: v for k, v in tensors.items() if k.startswith("decoder.")},
        "vocab": vocab,
        "encoder_weights": {k[len("encoder_weights.") :]: v for k, v in tensors.items() if k.startswith("encoder_w")},
        "familiarity": familiarity,
        "train": config["train"],
        "data": config["data"],
        "progress": {"step": config["step"], "epoch": 0, "batch_in_epoch": 0, "best": 0.0, "best_step": 0},
    }
    ck["model"] = {k[len("decoder.") :]: v for k, v in ck["model"].items()}
    torch.save(ck, path)
    return load_checkpoint(path)


def without_word_query(ck: dict) -> dict:
    """The model as a checkpoint from before the word query holds it: W_y dropped, maps as trained."""
    model = {k: v for k, v in ck["model"].items() if not k.startswith("attention.W_y")}
    decoder = {k: v for k, v in ck["decoder"].items() if k not in ("word_query", "decode_sharpness")}
    return {**ck, "model": model, "decoder": decoder}


def assert_same(got: list[dict], recorded: list[dict]) -> None:
    """Words equal, scores within 1e-4, maps within the recorded precision (and a little rounding)."""
    assert [g["file"] for g in got] == [r["file"] for r in recorded]
    for g, r in zip(got, recorded):
        assert g["caption"] == r["caption"], g["file"]
        assert g["score"] == pytest.approx(r["score"], abs=1e-4), g["file"]
        assert np.asarray(g["maps"]).shape == np.asarray(r["maps"]).shape, g["file"]
        np.testing.assert_allclose(g["maps"], r["maps"], atol=2e-4, rtol=0, err_msg=g["file"])


@pytest.fixture(scope="module")
def current(tmp_path_factory):
    return as_checkpoint(demo_model(), str(tmp_path_factory.mktemp("ck") / "bundled.pt"))


@pytest.fixture(scope="module")
def bundled():
    return Captioner.load(demo_model())


def test_the_bundled_model_writes_what_its_card_records(bundled):
    recorded = card_examples()
    assert len(recorded) == len(example_images()) and all(r["maps"] for r in recorded)
    assert_same(example_outputs(bundled, example_images()), recorded)


@pytest.mark.parametrize("version", [1, 2, 3, 5, 6])
def test_a_checkpoint_of_each_version_writes_what_its_model_wrote(current, bundled, tmp_path, version):
    """Each layout loads its decoder, vocabulary and settings (the encoder, the same in every layout, is the
    bundled model's, built once: rebuilding it is `test_the_bundled_model_writes_what_its_card_records`'s)."""
    ck = current if version >= 3 else without_word_query(current)
    path = tmp_path / f"v{version}.pt"
    files = {"init": None, "boxes": None}
    torch.save(ck if version == 6 else older(ck, version, early_decoder=version <= 2, files=files), path)
    recorded = card_examples()
    if version <= 2:
        with open(EARLY, encoding="utf-8") as f:
            recorded = json.load(f)
    loaded = Captioner.load(str(path), build_encoder=False)
    assert loaded.encoder_spec == bundled.encoder_spec
    loaded.encoder = bundled.encoder
    assert_same(example_outputs(loaded, example_images()), recorded)


def test_the_guard_sees_a_change_to_the_decoders_arithmetic(bundled, monkeypatch):
    """A decoder whose gating scalar is off by a little writes other outputs, and the guard says so."""
    from captioner.models.decoder import AttentionDecoder

    advance = AttentionDecoder.advance
    monkeypatch.setattr(
        AttentionDecoder, "advance", lambda self, f, alpha, *a, **k: advance(self, f * 1.01, alpha, *a, **k)
    )
    with pytest.raises(AssertionError):
        assert_same(example_outputs(bundled, example_images()), card_examples())


if __name__ == "__main__":  # record what the model without the word query writes (see the module doc)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        ck = without_word_query(as_checkpoint(demo_model(), os.path.join(tmp, "bundled.pt")))
        torch.save(older(ck, 2, early_decoder=True, files={"init": None, "boxes": None}), os.path.join(tmp, "v2.pt"))
        outputs = example_outputs(Captioner.load(os.path.join(tmp, "v2.pt")), example_images())
    with open(EARLY, "w", encoding="utf-8") as f:
        json.dump(outputs, f)
    print("\n".join(f"{o['file']}: {o['caption']} ({o['score']:.4f})" for o in outputs))
