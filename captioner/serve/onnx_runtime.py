"""Captioning on onnxruntime, without PyTorch: the folder `captioner export --onnx` writes, loaded by
`Captioner.load` or `captioner caption --runtime onnx` as by `OnnxCaptioner.load`.

Nothing here imports torch: Pillow reads and resizes the images, NumPy normalises them. The beam search
with the expected context is what runs here; sampling and hard attention's chosen locations need PyTorch.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
from PIL import Image

from captioner.data.images import load_image
from captioner.decoding.beams import search
from captioner.decoding.settings import Decoding
from captioner.errors import CaptionerError, OptionError
from captioner.io import read_folder_config, read_json
from captioner.models.contexts import EXPECTED
from captioner.models.preprocess import Preprocess
from captioner.models.vocab import Vocabulary
from captioner.serve.caption import Caption, CaptionModel, captions

FORMAT, VERSION = "captioner-onnx", 1
GRAPHS = {  # each graph's inputs and outputs, by name
    "encoder.onnx": (["images"], ["features"]),
    "start.onnx": (["features"], ["annotations", "projected", "h", "c"]),
    "step.onnx": (["annotations", "projected", "words", "h", "c", "sharpness"], ["logp", "h_next", "c_next", "alpha"]),
}
FILES = (*GRAPHS, "config.json", "vocab.json")


def on_onnx(path: str, runtime: str = "auto") -> bool:
    """Whether the model at `path` captions on onnxruntime, as `runtime` asks ("auto": where `captioner export
    --onnx` wrote the folder, judged by its config): the one check, for the API and the command line alike.
    Raises CaptionerError when onnxruntime is asked of another model, or PyTorch of ONNX graphs."""
    config = os.path.join(path, "config.json")
    config = read_json(config, "model config") if os.path.isdir(path) and os.path.isfile(config) else None
    onnx = isinstance(config, dict) and config.get("format") == FORMAT
    if runtime == "onnx" and not onnx:
        raise CaptionerError(f"{path}: --runtime onnx takes a folder that `captioner export --onnx` wrote")
    if runtime == "torch" and onnx:
        raise CaptionerError(f"{path}: holds ONNX graphs, which run on onnxruntime: --runtime onnx (or auto)")
    return onnx


class OnnxStep:
    """The exported step over the K beams of each image of a batch (the step `decoding.beams.search` takes)."""

    def __init__(self, model: OnnxCaptioner, features: np.ndarray, K: int, sharpness: float):
        self.run = model.sessions["step.onnx"].run
        (self.images, self.locations, _), self.beams, self.vocabulary = features.shape, K, len(model.vocab)
        start = model.sessions["start.onnx"].run(None, {"features": features})
        self.annotations, self.projected, h, c = (np.repeat(x, K, axis=0) for x in start)  # (N, ...)
        self.state, self.sharpness = (h, c), np.array(sharpness, dtype=np.float32)

    def start(self):
        return self.state

    def __call__(self, rows, words, h, c):
        a, p = (self.annotations, self.projected) if rows is None else (self.annotations[rows], self.projected[rows])
        inputs = {"annotations": a, "projected": p, "words": words, "h": h, "c": c, "sharpness": self.sharpness}
        logp, h, c, alpha = self.run(None, inputs)
        return logp, h, c, alpha, None


class OnnxCaptioner(CaptionModel):
    """A model exported as ONNX graphs, captioning on onnxruntime."""

    def __init__(self, folder: str, sessions: dict, config: dict, vocab: Vocabulary):
        self.folder, self.sessions, self.config, self.vocab = folder, sessions, config, vocab
        self.preprocess = Preprocess(int(config["preprocess"]["size"]), bool(config["preprocess"]["crop"]))
        self.grid, self.max_len = int(config["grid"]), int(config["max_len"])
        self.sharpness = float(config["decoder"].get("decode_sharpness") or 1.0)
        self.info = {k: config.get(k) for k in ("metrics", "attention", "card")} | {"checkpoint": folder}
        self.familiarity = None  # not exported (serve.onnx_export)

    @classmethod
    def load(cls, folder: str) -> OnnxCaptioner:
        """The folder's graphs in onnxruntime sessions, with its settings and vocabulary. Raises CaptionerError
        naming the file: a missing file, a config of another format or a newer version, a damaged graph, or
        graphs that do not fit each other or the vocabulary."""
        try:
            import onnxruntime
        except ImportError:
            raise CaptionerError("captioning on ONNX needs onnxruntime: pip install onnxruntime") from None
        config = read_folder_config(folder, FILES, kind="ONNX model", fmt=FORMAT, version=VERSION)
        vocab = Vocabulary(read_json(os.path.join(folder, "vocab.json"), "vocabulary").get("words") or [])
        options = onnxruntime.SessionOptions()
        # Threads that spin between runs take the cores the search's own steps and the image decoding need.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        sessions = {}
        for name, (inputs, outputs) in GRAPHS.items():
            path = os.path.join(folder, name)
            try:
                session = onnxruntime.InferenceSession(path, options, providers=["CPUExecutionProvider"])
            except Exception as e:  # onnxruntime's own errors: a damaged or foreign file
                line = (str(e).strip().splitlines() or [""])[0]
                raise CaptionerError(f"{path}: not a readable ONNX graph, truncated or corrupt ({line})") from None
            got = ([i.name for i in session.get_inputs()], [o.name for o in session.get_outputs()])
            if got != (inputs, outputs):
                raise CaptionerError(
                    f"{path}: takes {got[0]} and gives {got[1]}; {name} takes {inputs}, gives {outputs}"
                )
            sessions[name] = session
        _check_fit(folder, sessions, config, vocab)
        return cls(folder, sessions, config, vocab)

    def caption_batch(
        self, images: Sequence, beam_size: int | None = None, *, batch_size: int = 16, decoding=None, **settings
    ) -> list[Caption]:
        """`Captioner.caption_batch` on onnxruntime, which raises OptionError for what it does not run
        (sampling, a hard-attention location)."""
        settings = (decoding or Decoding()).with_settings(beam_size=beam_size, **settings)
        if settings.method != "beam" or settings.context != EXPECTED or settings.maps != "attention":
            raise OptionError(
                "the ONNX runtime runs the beam search with the expected context and draws the attention's maps; "
                "sampling, --mode argmax or sample and --maps posterior need PyTorch (the model's checkpoint or "
                "exported folder)"
            )
        out = []
        for i in range(0, len(images), batch_size):
            pils = [
                load_image(Image.fromarray(im) if isinstance(im, np.ndarray) else im)
                for im in images[i : i + batch_size]
            ]
            x = np.stack([self.preprocess.array(p) for p in pils])  # (b, 3, S, S)
            (features,) = self.sessions["encoder.onnx"].run(None, {"images": x})  # (b, L, D)
            step = OnnxStep(self, features, settings.beam_size, settings.sharpness or self.sharpness)
            found = search(step, settings.max_len or self.max_len, length_norm=settings.length_norm)
            out += captions(found, self.vocab, self.grid, settings, [p.size for p in pils], [None] * len(pils))
        return out


def _check_fit(folder: str, sessions: dict, config: dict, vocab: Vocabulary) -> None:
    """The graphs fit each other, the config and the vocabulary, where their shapes are fixed."""
    shape = lambda name, which, k: getattr(sessions[name], f"get_{which}")()[k].shape
    L = int(config["grid"]) ** 2
    checks = [
        ("encoder.onnx", shape("encoder.onnx", "outputs", 0)[1:], [L, config["decoder"]["encoder_dim"]], "features"),
        ("step.onnx", shape("step.onnx", "outputs", 0)[1:], [len(vocab)], "log-probabilities (the vocabulary)"),
        ("step.onnx", shape("step.onnx", "inputs", 0)[1:], shape("start.onnx", "outputs", 0)[1:], "annotations"),
    ]
    for name, got, want, what in checks:
        if list(got) != list(want):
            raise CaptionerError(
                f"{os.path.join(folder, name)}: {what} of shape {list(got)}, but the model's are {list(want)}"
            )
