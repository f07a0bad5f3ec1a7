"""ONNX: `captioner export --onnx` and captioning on onnxruntime by the one beam search, without torch.

Quick: a small model (the seeded random VGG16 at 64×64, a 4×4 grid, and a random decoder of a few units whose
words and maps follow the image) is exported once a session and captions four scenes whose captions differ,
on both runtimes, every beam checked against teacher forcing; its folder, damaged, is refused by name.
Slow: the bundled model is exported as users export it (the command line) and captions the bundled examples
on both runtimes, in-process and from the command line with torch blocked. The bundled model's tolerances
are ten times what was measured between the runtimes (scores 1.1e-5, maps 5.3e-6: docs/benchmarks.md, "ONNX").
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_cli
from PIL import Image

from captioner import Captioner, CaptionerError
from captioner.decoding.beams import search
from captioner.errors import OptionError
from captioner.models.checkpoint import Checkpoint, save_checkpoint
from captioner.models.decoder import AttentionDecoder, DecoderConfig
from captioner.models.encoder import EncoderSpec, build_encoder
from captioner.models.vocab import END_ID, PAD_ID, SPECIALS, START_ID
from captioner.serve.onnx_export import export_onnx
from captioner.serve.onnx_runtime import OnnxCaptioner, OnnxStep
from captioner.serve.sources import demo_model, example_images

slow = pytest.mark.slow  # exports VGG16 at 224 (about 10 s), then captions on both runtimes

SCORES, MAPS = 1e-4, 1e-4
# The small model's: ten times what was measured between the runtimes, and between the ONNX search and teacher
# forcing, under AVX2 and AVX-512 alike (the JSON's maps are rounded to 1e-5).
SMALL_SCORES, SMALL_MAPS = 2e-4, 2e-5
FORCED_SCORES, FORCED_MAPS = 3e-5, 1e-5
WORDS = [*SPECIALS, "a", "red", "blue", "green", "circle", "square", "star", "left", "of", "right", "above", "below"]


def scene(i: int) -> np.ndarray:
    """A flat colour with a square of its complement in one quadrant (64×80×3 uint8)."""
    colour = np.array([(200, 40, 40), (40, 200, 40), (40, 40, 200), (220, 220, 60)][i], dtype=np.uint8)
    im = np.broadcast_to(colour, (64, 80, 3)).copy()
    row, col = divmod(i, 2)
    im[8 + 24 * row : 32 + 24 * row, 8 + 32 * col : 40 + 32 * col] = 255 - colour
    return im


SCENES = [scene(i) for i in range(4)]


@pytest.fixture(scope="session")
def small(tmp_path_factory) -> Path:
    """A small model's checkpoint (`small/model.pt`) and its ONNX folder (`small/onnx`), exported in process.

    The decoder is random, its weights scaled so that its maps are peaked, its words follow the context
    (annotations read from another image change them) and its beams end at different lengths, none of the
    scenes' captions alike (checked below); of the seeds that do so, one whose candidates are nowhere near a
    tie, so that the runtimes' rounding cannot reorder its beams."""
    out = tmp_path_factory.mktemp("small")
    encoder, spec = build_encoder(EncoderSpec(weights="none", image_size=64))
    with torch.no_grad():
        features = encoder(torch.stack([spec.preprocess(Image.fromarray(im)) for im in SCENES]))  # (4, 16, 512)
    cfg = DecoderConfig.paper(vocab_size=len(WORDS), embed_dim=16, hidden_dim=24, attention_dim=12, dropout=0.0)
    with torch.random.fork_rng(), torch.no_grad():
        torch.manual_seed(10)
        decoder = AttentionDecoder(cfg).eval()
        decoder.set_feature_stats(features.mean((0, 1)), features.std((0, 1)))
        decoder.attention.v.weight.mul_(8.0)
        decoder.L_o.weight.mul_(2.0)
        decoder.L_z.weight.mul_(4.0)
        decoder.lstm_z.weight.mul_(3.0)
        decoder.L_o.bias[END_ID] += 1.0
    ck = Checkpoint(decoder.state_dict(), cfg.to_dict(), WORDS, spec.to_dict(), max_len=8, step=0)
    save_checkpoint(ck, str(out / "model.pt"))
    export_onnx(str(out / "model.pt"), str(out / "onnx"))
    return out


@pytest.fixture(scope="session")
def small_torch(small) -> Captioner:
    # The plain encoder, quicker to load: the fast one gives its features (tests/test_fast_paths.py).
    return Captioner.load(str(small / "model.pt"), fast=False)


@pytest.fixture(scope="session")
def small_onnx(small) -> OnnxCaptioner:
    onnx = Captioner.load(str(small / "onnx"))
    assert isinstance(onnx, OnnxCaptioner)
    return onnx


@pytest.mark.parametrize("settings", [dict(beam_size=3), dict(beam_size=1), dict(beam_size=5, length_norm=True)])
def test_onnx_writes_the_words_scores_and_maps_pytorch_writes_on_a_small_model(small_torch, small_onnx, settings):
    """Four scenes in one batch: a search that read another image's annotations, or another beam's maps,
    writes other words, scores or maps than PyTorch."""
    want = small_torch.caption_batch(SCENES, **settings)
    assert len({c.text for c in want}) == len(SCENES)  # each scene its own caption
    for a, b in zip(want, small_onnx.caption_batch(SCENES, **settings), strict=True):
        assert a.words == b.words and [t for t, _ in a.alternatives] == [t for t, _ in b.alternatives]
        np.testing.assert_allclose([s for _, s in b.alternatives], [s for _, s in a.alternatives], atol=SMALL_SCORES)
        np.testing.assert_allclose(b.attention, a.attention, atol=SMALL_MAPS, rtol=0)
        assert b.size == a.size == (80, 64) and b.attention.shape == (len(b.words), 4, 4)


def test_every_onnx_beam_is_its_words_rescored_by_teacher_forcing(small_torch, small_onnx):
    """Every hypothesis of the ONNX search, re-run through the PyTorch decoder word by word on the same
    features: its score is its words' and <end>'s log-probabilities, and each map the one for its word.
    This holds whatever search both runtimes share."""
    onnx, decoder = small_onnx, small_torch.decoder
    x = np.stack([onnx.preprocess.array(Image.fromarray(im)) for im in SCENES])  # (4, 3, 64, 64)
    (features,) = onnx.sessions["encoder.onnx"].run(None, {"images": x})  # (4, L, D)
    found = search(OnnxStep(onnx, features, 3, onnx.sharpness), onnx.max_len)
    assert len({len(h.tokens) for hyps in found for h in hyps}) > 2  # beams of several lengths
    for feats, hyps in zip(torch.from_numpy(features), found):
        n = max(len(h.tokens) for h in hyps) + 2
        captions = torch.full((len(hyps), n), PAD_ID)  # (K, n) <start> words <end>, then <pad>
        for i, h in enumerate(hyps):
            captions[i, : len(h.tokens) + 2] = torch.tensor([START_ID, *h.tokens, END_ID])
        lengths = torch.tensor([len(h.tokens) + 2 for h in hyps])
        with torch.no_grad():
            logits, alphas = decoder(feats.expand(len(hyps), -1, -1), captions, lengths)  # (K, n-1, V), (K, n-1, L)
        logp = logits.double().log_softmax(-1).gather(2, captions[:, 1:, None])[..., 0]  # (K, n-1)
        for i, h in enumerate(hyps):
            k = len(h.tokens)
            assert h.score == pytest.approx(float(logp[i, : k + 1].sum()), abs=FORCED_SCORES), h.tokens
            np.testing.assert_allclose(h.attention, alphas[i, :k].numpy(), atol=FORCED_MAPS, rtol=0)


def test_onnx_refuses_what_it_does_not_run_by_name(small_onnx):
    with pytest.raises(OptionError, match="ONNX runtime runs the beam search"):
        small_onnx.caption(SCENES[0], method="sampling")
    with pytest.raises(OptionError, match="ONNX runtime"):
        small_onnx.caption(SCENES[0], mode="argmax")
    with pytest.raises(OptionError, match="--maps posterior need PyTorch"):
        small_onnx.caption(SCENES[0], maps="posterior")


def test_the_command_line_captions_a_small_model_on_onnx_where_torch_cannot_be_imported(small, small_torch, tmp_path):
    """`captioner caption --runtime onnx` in a process whose `import torch` fails: the captions and maps
    PyTorch writes, in the JSON."""
    paths = []
    for i, im in enumerate(SCENES):
        paths.append(str(tmp_path / f"scene{i}.png"))
        Image.fromarray(im).save(paths[-1])
    out = tmp_path / "out.json"
    args = ["--runtime", "onnx", "--checkpoint", str(small / "onnx"), "--json", str(out), "--attention"]
    p = run_cli(
        "-m", "captioner", "caption", *paths, *args, "--workers", "0", cwd=tmp_path, env=torch_blocked(tmp_path)
    )
    assert p.returncode == 0, p.stderr[-3000:]
    want = small_torch.caption_batch(paths)
    for record, caption in zip(json.loads(out.read_text()), want, strict=True):
        assert record["caption"] == caption.text and record["words"] == caption.words
        np.testing.assert_allclose(record["attention"], caption.attention, atol=SMALL_MAPS, rtol=0)


def torch_blocked(tmp_path: Path) -> dict:
    """An environment whose `import torch` fails (checked)."""
    blocked = tmp_path / "blocked" / "torch"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text('raise ImportError("torch cannot be imported in this test")\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(blocked.parent), os.getenv("PYTHONPATH")]))}
    probe = run_cli("-c", "import torch", env=env)
    assert probe.returncode != 0 and "cannot be imported" in probe.stderr
    return env


def damaged(folder: Path, tmp_path: Path, name: str, change) -> str:
    """A copy of the folder with one file changed (the others linked: the encoder's graph is the largest)."""
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in folder.iterdir():
        (copy / f.name).symlink_to(f)
    (copy / name).unlink()
    shutil.copy(folder / name, copy / name)
    change(copy / name)
    return str(copy)


def truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])


def fewer_words(path):
    vocab = json.loads(path.read_text())
    path.write_text(json.dumps({"words": vocab["words"][:-1]}))


@pytest.mark.parametrize(
    "name, change, said",
    [
        ("step.onnx", truncate, r"step\.onnx: not a readable ONNX graph"),
        ("encoder.onnx", lambda p: p.write_bytes(b"not a graph"), r"encoder\.onnx: not a readable ONNX graph"),
        ("step.onnx", lambda p: shutil.copy(p.parent / "start.onnx", p), r"step\.onnx: takes \['features'\]"),
        ("vocab.json", fewer_words, r"step\.onnx: log-probabilities \(the vocabulary\) of shape \[16\].*\[15\]"),
        ("start.onnx", lambda p: p.unlink(), r"missing start\.onnx"),
        ("config.json", lambda p: p.write_text(json.dumps({"format": "captioner-onnx", "version": 9})), "version 9"),
    ],
)
def test_a_damaged_or_mismatched_file_is_refused_by_name(small, tmp_path, name, change, said):
    with pytest.raises(CaptionerError, match=said):
        Captioner.load(damaged(small / "onnx", tmp_path, name, change))


# the bundled model, end to end


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> str:
    """The bundled model exported by `captioner export --onnx DIR`."""
    out = tmp_path_factory.mktemp("onnx") / "model"
    p = run_cli("-m", "captioner", "export", "--onnx", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "encoder.onnx" in p.stdout and sorted(os.listdir(out)) == sorted(
        ["encoder.onnx", "start.onnx", "step.onnx", "config.json", "vocab.json"]
    )
    return str(out)


@pytest.fixture(scope="module")
def on_torch():
    return Captioner.load(demo_model())


@slow
@pytest.mark.parametrize("settings", [dict(beam_size=3), dict(beam_size=1), dict(beam_size=5, length_norm=True)])
def test_onnx_writes_the_words_scores_and_maps_pytorch_writes(exported, on_torch, settings):
    onnx = Captioner.load(exported)
    assert isinstance(onnx, OnnxCaptioner)
    pairs = zip(on_torch.caption_batch(example_images(), **settings), onnx.caption_batch(example_images(), **settings))
    for a, b in pairs:
        assert a.words == b.words and [t for t, _ in a.alternatives] == [t for t, _ in b.alternatives]
        assert b.score == pytest.approx(a.score, abs=SCORES)
        np.testing.assert_allclose(b.attention, a.attention, atol=MAPS, rtol=0)
        assert b.size == a.size and b.attention.shape == (len(b.words), 14, 14)


@slow
def test_the_command_line_captions_on_onnx_where_torch_cannot_be_imported(exported, on_torch, tmp_path):
    """`captioner caption --runtime onnx` in a process whose `import torch` fails: the captions and maps
    PyTorch writes, in the JSON."""
    out = tmp_path / "out.json"
    args = ["--runtime", "onnx", "--checkpoint", exported, "--json", str(out), "--attention", "--workers", "0"]
    p = run_cli("-m", "captioner", "caption", *example_images(), *args, cwd=tmp_path, env=torch_blocked(tmp_path))
    assert p.returncode == 0, p.stderr[-3000:]
    results = json.loads(out.read_text())
    for record, want in zip(results, on_torch.caption_batch(example_images())):
        assert record["caption"] == want.text and record["words"] == want.words
        np.testing.assert_allclose(record["attention"], want.attention, atol=MAPS, rtol=0)
    p = run_cli("-m", "captioner", "caption", example_images()[0], "--checkpoint", exported, "--runtime", "torch")
    assert p.returncode != 0 and "holds ONNX graphs" in p.stderr
