"""Sharing a trained model: `captioner export`, and loading it by path, pinned URL or hf:// id."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import zipfile

import numpy as np
import pytest
from conftest import run_cli

from captioner import Captioner, CaptionerError
from captioner.serve.export import export

HUB_ID = "captioner-tests/tiny"


@pytest.fixture(scope="module")
def exported(small_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("exported") / "tiny"
    p = run_cli("-m", "captioner", "export", str(small_run / "best.pt"), str(out))
    assert p.returncode == 0, p.stderr
    return out


@pytest.fixture(scope="module")
def image(scenes):
    return str(sorted((scenes / "images").iterdir())[0])


def same_captions(a: Captioner, b: Captioner, images: list[str]) -> None:
    for x, y in zip(a.caption_batch(images, beam_size=3), b.caption_batch(images, beam_size=3)):
        assert x.words == y.words
        np.testing.assert_allclose(x.attention, y.attention, atol=1e-4)
        assert x.familiarity == y.familiarity


def test_export_writes_weights_config_vocabulary_and_a_card(exported, small_run, scenes):
    assert {"model.safetensors", "config.json", "vocab.json", "README.md"} <= set(os.listdir(exported))
    config = json.loads((exported / "config.json").read_text())
    assert config["format"] == "captioner-model" and config["version"] == 2
    assert config["decoder"]["vocab_size"] == len(json.loads((exported / "vocab.json").read_text())["words"])
    assert config["preprocess"]["size"] == config["encoder"]["image_size"]
    card = (exported / "README.md").read_text()
    for heading in ("## Trained on", "## Scores", "## How it was made", "## Limits", "## Use it"):
        assert heading in card
    assert "trained by calling fit() from Python" in card  # how it was made (train.py records its command line)
    images = [str(p) for p in sorted((scenes / "images").iterdir())[:4]]
    same_captions(Captioner.load(str(small_run / "best.pt")), Captioner.load(str(exported)), images)


def test_an_exported_model_decodes_with_its_own_sharpness_and_its_card_says_so(small_run, exported, tmp_path):
    from captioner.models.checkpoint import load_checkpoint, save_checkpoint

    assert "sharper" not in (exported / "README.md").read_text()  # decodes with the maps as trained
    ck = load_checkpoint(str(small_run / "best.pt"))
    ck["decoder"]["decode_sharpness"] = 3.0
    save_checkpoint({k: v for k, v in ck.items() if k != "format"}, str(tmp_path / "sharp.pt"))
    out = export(str(tmp_path / "sharp.pt"), str(tmp_path / "sharp"))
    assert "softmax(3 e)" in (tmp_path / "sharp" / "README.md").read_text()
    assert Captioner.load(out).decoder.config.decode_sharpness == 3.0


def hub_cache(root, exported) -> str:
    """A Hugging Face cache holding `exported` as HUB_ID, laid out as huggingface_hub lays it out."""
    repo = root / ("models--" + HUB_ID.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "blobs").mkdir()
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in exported.iterdir():
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy(f, repo / "blobs" / digest)
        os.symlink(os.path.join("..", "..", "blobs", digest), snapshot / f.name)
    return str(root)


@pytest.mark.slow
def test_hf_id_loads_from_the_hub_cache_offline(exported, small_run, tmp_path, monkeypatch, scenes, image):
    from huggingface_hub import constants

    cache = hub_cache(tmp_path / "hub", exported)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", cache)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    images = [str(p) for p in sorted((scenes / "images").iterdir())[:3]]
    same_captions(Captioner.load(str(small_run / "best.pt")), Captioner.load(f"hf://{HUB_ID}"), images)
    with pytest.raises(CaptionerError, match="not in the Hugging Face cache .* HF_HUB_OFFLINE"):
        Captioner.load("hf://captioner-tests/absent")
    # As a user runs it: the environment variables, the command line.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": cache}
    p = run_cli("-m", "captioner", "caption", image, "--checkpoint", f"hf://{HUB_ID}", "--device", "cpu", env=env)
    want = Captioner.load(str(small_run / "best.pt")).caption(image).text
    assert p.returncode == 0 and p.stdout.strip().split("\t")[1] == want, p.stderr


def test_a_pinned_url_of_a_zipped_folder_loads(exported, small_run, tmp_path, monkeypatch, image):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    archive = tmp_path / "tiny.zip"
    with zipfile.ZipFile(archive, "w") as z:
        for f in exported.iterdir():
            z.write(f, f"tiny/{f.name}")
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    cap = Captioner.load(f"{archive.as_uri()}#sha256={digest}")
    assert cap.caption(image).words == Captioner.load(str(small_run / "best.pt")).caption(image).words


@pytest.mark.slow
@pytest.mark.parametrize(
    "damage, message",
    [
        (
            lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:5000]),
            r"model.safetensors: not a readable safetensors file, truncated or corrupt",
        ),
        (lambda d: (d / "model.safetensors").write_bytes(b"\x00" * 64), r"model.safetensors: not a readable"),
        (
            lambda d: (d / "config.json").write_text(
                json.dumps({**json.loads((d / "config.json").read_text()), "version": 99})
            ),
            r"config.json: version 99 was written by a newer captioner",
        ),
        (
            lambda d: (d / "vocab.json").write_text(json.dumps({"words": ["<pad>", "<start>", "<end>", "<unk>"]})),
            r"vocab.json: 4 words, but the weights in model.safetensors are for",
        ),
        (lambda d: (d / "vocab.json").unlink(), r"missing vocab.json"),
        (lambda d: (d / "config.json").write_text("[1, 2]"), r"config.json: not a captioner exported model config"),
    ],
)
def test_bad_files_are_refused_with_a_message(exported, tmp_path, damage, message, image):
    broken = tmp_path / "broken"
    shutil.copytree(exported, broken)
    damage(broken)
    with pytest.raises(CaptionerError, match=message):
        Captioner.load(str(broken))
    p = run_cli("-m", "captioner", "caption", image, "--checkpoint", str(broken), "--device", "cpu")
    assert p.returncode == 2 and "error:" in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_the_bundled_model_is_an_exported_folder():
    from captioner.serve.sources import demo_model

    assert {"model.safetensors", "config.json", "vocab.json", "README.md"} <= set(os.listdir(demo_model()))
    assert not any(name.endswith(".pt") for name in os.listdir(os.path.dirname(demo_model())))


def test_export_in_python_returns_the_folder(small_run, tmp_path):
    assert export(str(small_run / "best.pt"), str(tmp_path / "m")) == str(tmp_path / "m")
