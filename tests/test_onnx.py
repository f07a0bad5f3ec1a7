"""ONNX: `captioner export --onnx` and captioning on onnxruntime by the one beam search, without torch.

The bundled model is exported once (as users export it, from the command line) and captions the bundled
examples on both runtimes. The tolerances are ten times what was measured between them (scores 1.1e-5,
maps 5.3e-6: docs/benchmarks.md, "ONNX").
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from conftest import run_cli

from captioner import Captioner, CaptionerError
from captioner.errors import OptionError
from captioner.serve.onnx_runtime import OnnxCaptioner
from captioner.serve.sources import demo_model, example_images

pytestmark = pytest.mark.slow  # exports VGG16 (about 10 s), then captions on both runtimes

SCORES, MAPS = 1e-4, 1e-4


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


def test_onnx_refuses_what_it_does_not_run_by_name(exported):
    onnx = OnnxCaptioner.load(exported)
    with pytest.raises(OptionError, match="ONNX runtime runs the beam search"):
        onnx.caption(example_images()[0], method="sampling")
    with pytest.raises(OptionError, match="ONNX runtime"):
        onnx.caption(example_images()[0], mode="argmax")


def damaged(folder: str, tmp_path, name: str, change) -> str:
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
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
        ("vocab.json", fewer_words, r"step\.onnx: log-probabilities \(the vocabulary\) of shape \[43\].*\[42\]"),
        ("start.onnx", lambda p: p.unlink(), r"missing start\.onnx"),
        ("config.json", lambda p: p.write_text(json.dumps({"format": "captioner-onnx", "version": 9})), "version 9"),
    ],
)
def test_a_damaged_or_mismatched_file_is_refused_by_name(exported, tmp_path, name, change, said):
    with pytest.raises(CaptionerError, match=said):
        Captioner.load(damaged(exported, tmp_path, name, change))


def test_the_command_line_captions_on_onnx_where_torch_cannot_be_imported(exported, on_torch, tmp_path):
    """`captioner caption --runtime onnx` in a process whose `import torch` fails: the captions and maps
    PyTorch writes, in the JSON."""
    blocked = tmp_path / "blocked" / "torch"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text('raise ImportError("torch cannot be imported in this test")\n')
    env = {**os.environ, "PYTHONPATH": str(blocked.parent)}
    out = tmp_path / "out.json"
    args = ["--runtime", "onnx", "--checkpoint", exported, "--json", str(out), "--attention", "--workers", "0"]
    p = run_cli("-m", "captioner", "caption", *example_images(), *args, cwd=tmp_path, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    results = json.loads(out.read_text())
    for record, want in zip(results, on_torch.caption_batch(example_images())):
        assert record["caption"] == want.text and record["words"] == want.words
        np.testing.assert_allclose(record["attention"], want.attention, atol=MAPS, rtol=0)
    probe = run_cli("-c", "import torch", env=env)
    assert probe.returncode != 0 and "cannot be imported" in probe.stderr  # the block held
    p = run_cli("-m", "captioner", "caption", example_images()[0], "--checkpoint", exported, "--runtime", "torch")
    assert p.returncode != 0 and "holds ONNX graphs" in p.stderr
