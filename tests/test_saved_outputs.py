"""Saved models write what they wrote when they were saved: the guard of every change to the decoder,
the search and the loading code.

The bundled model's card records, for each bundled example, the caption, its score and every word's map
as the page captions it (`tools.demo_examples.record_outputs`). Here the bundled model, and a checkpoint of
every layout `models.checkpoint` migrates (tests/test_checkpoint_versions.py writes them out), caption the
examples again. Versions 1 and 2 predate the word query, so their checkpoint is the bundled model without
it (its W_y dropped, maps as trained): what that model wrote is recorded in saved_outputs.json beside this
file. A change meant to move these outputs records them again: `python -m tools.demo_examples` for the
card, `python tests/test_saved_outputs.py` for the file; say why in the commit. `python
tests/test_saved_outputs.py spread` measures how far apart the outputs are under each of KERNELS.

The bundled model's guard runs on this machine as it is, and as machines with older CPUs (`KERNELS`: the CPU
kernels PyTorch, oneDNN and MKL pick there), each in a process of its own, since a process picks them once.
The tolerances are set from the spread measured across kernel sets (docs/benchmarks.md, "The same outputs on
every CPU"): well inside what a 1% change to the gating scalar moves.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from captioner import Captioner
from captioner.demo.card import example_outputs
from captioner.models import decoder as decoder_module
from captioner.models.checkpoint import load_checkpoint
from captioner.models.decoder import AttentionDecoder, lstm_cell
from captioner.models.vocab import Vocabulary
from captioner.serve.sources import demo_model, example_images

sys.path.insert(0, os.path.dirname(__file__))
from test_checkpoint_versions import older  # noqa: E402

ADVANCE = AttentionDecoder.advance
EARLY = os.path.join(os.path.dirname(__file__), "saved_outputs.json")  # the model without the word query

# Measured across MEASURED (docs/benchmarks.md): scores within 6e-6, maps within 5e-6; maps are recorded to
# 4 decimals, so two roundings of equal maps can differ by one unit, 1e-4.
SCORE_TOLERANCE = 5e-5
MAP_TOLERANCE = 1.5e-4

# The machines the guard runs as, besides this one as it is (in this process): the variables that make ATen,
# oneDNN (the encoder's convolutions) and MKL (the decoder's products) pick the kernels of such a machine, and
# the capability ATen then reports.
KERNELS = {
    "an AVX2 machine": (
        {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
        "AVX2",
    ),
    "a machine without AVX": (
        {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
        "DEFAULT",
    ),
}
# The kernel sets the tolerances were measured across (`python tests/test_saved_outputs.py spread`): KERNELS,
# and each library's choice moved alone.
MEASURED = {
    "as this machine picks": ({}, None),
    "ATen without vector code": ({"ATEN_CPU_CAPABILITY": "default"}, "DEFAULT"),
    "ATen AVX2": ({"ATEN_CPU_CAPABILITY": "avx2"}, "AVX2"),
    "ATen AVX-512": ({"ATEN_CPU_CAPABILITY": "avx512"}, "AVX512"),
    "oneDNN capped at AVX2": ({"ONEDNN_MAX_CPU_ISA": "AVX2"}, None),
    "oneDNN capped at SSE4.1": ({"ONEDNN_MAX_CPU_ISA": "SSE41"}, None),
    "MKL capped at AVX2": ({"MKL_ENABLE_INSTRUCTIONS": "AVX2"}, None),
    **KERNELS,
}
# What a process under one of them prints: the capability ATen took, and the bundled model's outputs as the
# card records them (given "raw": not rounded).
PROBE = """
import json, sys, torch
from captioner import Captioner
from captioner.demo.card import example_outputs
from captioner.demo.options import PAGE_BEAM
from captioner.serve.sources import demo_model, example_images
captioner = Captioner.load(demo_model())
if sys.argv[1:] == ["raw"]:
    outs = captioner.caption_batch(example_images(), beam_size=PAGE_BEAM)
    outputs = [{"score": out.score, "maps": out.attention.tolist()} for out in outs]
else:
    outputs = example_outputs(captioner, example_images())
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "outputs": outputs}))
"""


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
    """Words equal, scores and maps within the tolerances measured across CPU kernels (module doc)."""
    assert [g["file"] for g in got] == [r["file"] for r in recorded]
    for g, r in zip(got, recorded):
        assert g["caption"] == r["caption"], g["file"]
        assert g["score"] == pytest.approx(r["score"], abs=SCORE_TOLERANCE), g["file"]
        assert np.asarray(g["maps"]).shape == np.asarray(r["maps"]).shape, g["file"]
        np.testing.assert_allclose(g["maps"], r["maps"], atol=MAP_TOLERANCE, rtol=0, err_msg=g["file"])


@pytest.fixture(scope="module")
def current(tmp_path_factory):
    return as_checkpoint(demo_model(), str(tmp_path_factory.mktemp("ck") / "bundled.pt"))


class RememberedEncoder(torch.nn.Module):
    """An encoder that computes each input's features once: the guard's many captionings of the same examples
    differ in the decoder and the loading, not in the encoder."""

    def __init__(self, encoder: torch.nn.Module):
        super().__init__()
        self.encoder, self.seen = encoder, {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        key = (tuple(x.shape), x.numpy().tobytes())
        if key not in self.seen:
            self.seen[key] = self.encoder(x)
        return self.seen[key]


@pytest.fixture(scope="module")
def bundled():
    captioner = Captioner.load(demo_model())
    captioner.encoder = RememberedEncoder(captioner.encoder)
    return captioner


def outputs_under(kernels: dict, *args: str) -> dict[str, dict]:
    """The probe's answer under each of `kernels`, all run at once, one thread each."""

    def probe(env: dict) -> dict:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **env}
        command = [sys.executable, "-c", PROBE, *args]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    with ThreadPoolExecutor(len(kernels)) as pool:
        return dict(zip(kernels, pool.map(probe, [env for env, _ in kernels.values()])))


@pytest.fixture(scope="module")
def as_other_machines() -> dict[str, dict]:
    return outputs_under(KERNELS)


def test_the_bundled_model_writes_what_its_card_records(bundled):
    recorded = card_examples()
    assert len(recorded) == len(example_images()) and all(r["maps"] for r in recorded)
    assert_same(example_outputs(bundled, example_images()), recorded)


@pytest.mark.parametrize("machine", list(KERNELS))
def test_the_bundled_model_writes_it_with_another_machines_kernels(as_other_machines, machine):
    answer, asked = as_other_machines[machine], KERNELS[machine][1]
    assert answer["capability"] == asked, f"{machine}: ATen runs {answer['capability']}, not {asked}"
    assert_same(answer["outputs"], card_examples())


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


def _swapped_gates(gates, c):
    i, f, o, g = gates.chunk(4, dim=1)
    return lstm_cell(torch.cat([f, i, o, g], dim=1), c)


# Changes to the model the guard must see: each of them writes other outputs.
MUTATIONS = {
    "the gating scalar off by 1%": lambda cap, patch: patch.setattr(
        AttentionDecoder, "advance", lambda self, f, *a, **k: ADVANCE(self, f * 1.01, *a, **k)
    ),
    "the LSTM's input and forget gates swapped": lambda cap, patch: patch.setattr(
        decoder_module, "lstm_cell", _swapped_gates
    ),
    "β not applied (always 1)": lambda cap, patch: patch.setattr(
        cap.decoder.f_beta, "forward", lambda h: h.new_full((h.size(0), 1), 60.0)
    ),
    "the vocabulary in another order": lambda cap, patch: patch.setattr(
        cap, "vocab", Vocabulary([*cap.vocab.words[:4], *sorted(cap.vocab.words[4:])])
    ),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_the_guard_sees_a_change_to_the_model(bundled, monkeypatch, mutation):
    MUTATIONS[mutation](bundled, monkeypatch)
    with pytest.raises(AssertionError):
        assert_same(example_outputs(bundled, example_images()), card_examples())


def spread() -> None:
    """Print how far apart the bundled model's outputs are under MEASURED (not rounded), and from its card."""
    answers = {
        k: v
        for k, v in outputs_under(MEASURED, "raw").items()
        if v["capability"] == (MEASURED[k][1] or v["capability"])
    }
    recorded, names = card_examples(), list(answers)
    largest = lambda a, b, key: max(np.abs(np.subtract(np.ravel(x[key]), np.ravel(y[key]))).max() for x, y in zip(a, b))
    for name in names:
        got = answers[name]["outputs"]
        print(
            f"{name} ({answers[name]['capability']}): from the card, scores {largest(got, recorded, 'score'):.1e}, "
            f"maps {largest(got, recorded, 'maps'):.1e}"
        )
    pairs = [(answers[a]["outputs"], answers[b]["outputs"]) for a in names for b in names]
    print(
        f"between kernel sets: scores {max(largest(a, b, 'score') for a, b in pairs):.1e}, "
        f"maps {max(largest(a, b, 'maps') for a, b in pairs):.1e}"
    )


if __name__ == "__main__" and sys.argv[1:] == ["spread"]:
    spread()
elif __name__ == "__main__":  # record what the model without the word query writes (see the module doc)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        ck = without_word_query(as_checkpoint(demo_model(), os.path.join(tmp, "bundled.pt")))
        torch.save(older(ck, 2, early_decoder=True, files={"init": None, "boxes": None}), os.path.join(tmp, "v2.pt"))
        outputs = example_outputs(Captioner.load(os.path.join(tmp, "v2.pt")), example_images())
    with open(EARLY, "w", encoding="utf-8") as f:
        json.dump(outputs, f)
    print("\n".join(f"{o['file']}: {o['caption']} ({o['score']:.4f})" for o in outputs))
