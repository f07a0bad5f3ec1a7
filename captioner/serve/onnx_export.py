"""`captioner export --onnx DIR`: a trained model as ONNX graphs, for onnxruntime without PyTorch.

Writes:

    DIR/encoder.onnx   images (B, 3, S, S), ImageNet-normalised → features (B, L, D)
    DIR/start.onnx     features (B, L, D) → standardised annotations (B, L, D), their projection 2 W_a a_i
                       (B, L, A), h_0 and c_0 (B, H)
    DIR/step.onnx      the decoder's step with attention over N rows: annotations (N, L, D), projection
                       (N, L, A), last words (N,), h, c (N, H), sharpness k () → log-probabilities (N, V),
                       h, c (N, H), α (N, L); soft attention's expected context
    DIR/config.json    format and version, the decoder's settings, preprocessing, grid, max_len, step, and
                       the model's record (metrics, attention verdict, card)
    DIR/vocab.json     {"words": [...]}, in id order

The batch (B, N) is dynamic. The training-feature statistics (`familiarity`) are not exported: the ONNX
runtime does not say whether an image is like the training images.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from captioner.errors import CaptionerError
from captioner.io import atomic_path, write_json_atomic
from captioner.models.decoder import AttentionDecoder
from captioner.models.encoder import rebuild_encoder
from captioner.models.hub import load_trained
from captioner.models.preprocess import IMAGENET_MEAN, IMAGENET_STD
from captioner.serve.onnx_runtime import FORMAT, GRAPHS, VERSION

OPSET = 18


class Start(nn.Module):
    """The search's start from an image's features (`AttentionDecoder.start`), as a module to export."""

    def __init__(self, decoder: AttentionDecoder):
        super().__init__()
        self.decoder = decoder

    def forward(self, features: torch.Tensor):
        return self.decoder.start(features)


class Step(nn.Module):
    """The decoder's step with the expected context, its weights joined once, ending in log-probabilities."""

    def __init__(self, decoder: AttentionDecoder):
        super().__init__()
        self.decoder = decoder
        joined = decoder.joined()
        self.register_buffer("lstm", joined.lstm.detach().clone())
        self.register_buffer("output", joined.output.detach().clone())

    def forward(self, features, projected, words, h, c, sharpness):
        joined = type(self.decoder.joined())(self.lstm, self.output)
        logits, h, c, alpha, _ = self.decoder.step(features, projected, words, h, c, joined=joined, sharpness=sharpness)
        return logits.float().log_softmax(dim=-1), h, c, alpha


def export_onnx(source: str, out_dir: str) -> str:
    """Write the ONNX folder of a model (a checkpoint, an exported folder, a pinned URL or hf://ORG/NAME),
    and return it. Raises CaptionerError when the model cannot be read, or onnxscript is missing."""
    try:
        import onnxscript  # noqa: F401 - torch.onnx's dynamo exporter needs it
    except ImportError:
        raise CaptionerError(
            "captioner export --onnx needs onnx and onnxscript: pip install 'captioner[onnx]'"
        ) from None
    trained = load_trained(source)
    encoder = rebuild_encoder(trained.encoder, trained.encoder_state, source, trained.encoder_weights)[0].eval()
    decoder = trained.decoder.float().eval()
    cfg, spec = decoder.config, trained.encoder
    S, L, D = spec.image_size, spec.grid**2, cfg.encoder_dim
    os.makedirs(out_dir, exist_ok=True)
    batch, rows = torch.export.Dim("batch", min=1), torch.export.Dim("rows", min=1)
    images = torch.zeros(2, 3, S, S)
    features = torch.zeros(2, L, D)
    with torch.no_grad():
        _write(encoder, (images,), out_dir, "encoder.onnx", ({0: batch},))
        _write(Start(decoder), (features,), out_dir, "start.onnx", ({0: batch},))
        A, H = cfg.attention_dim, cfg.hidden_dim
        example = (
            torch.zeros(3, L, D),
            torch.zeros(3, L, A),
            torch.ones(3, dtype=torch.long),
            torch.zeros(3, H),
            torch.zeros(3, H),
            torch.tensor(1.0),
        )
        _write(Step(decoder), example, out_dir, "step.onnx", ({0: rows},) * 5 + ({},))
    config = {
        "format": FORMAT,
        "version": VERSION,
        "decoder": cfg.to_dict(),
        "encoder": spec.to_dict(),
        "preprocess": {"size": S, "crop": spec.crop, "mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD)},
        "grid": spec.grid,
        "max_len": int(trained.max_len),
        "step": int(trained.step),
        **{k: trained.info.get(k) for k in ("metrics", "attention", "card")},
    }
    write_json_atomic(os.path.join(out_dir, "config.json"), config)
    write_json_atomic(os.path.join(out_dir, "vocab.json"), {"words": trained.vocab.words})
    return out_dir


def _write(module: nn.Module, args: tuple, out_dir: str, name: str, dims: tuple) -> None:
    """One graph, its inputs and outputs named as `GRAPHS` says, written atomically."""
    inputs, outputs = GRAPHS[name]
    program = torch.onnx.export(
        module.eval(),
        args,
        dynamo=True,
        input_names=inputs,
        output_names=outputs,
        dynamic_shapes=dims,
        opset_version=OPSET,
        verbose=False,
    )
    with atomic_path(os.path.join(out_dir, name)) as tmp:
        program.save(tmp)
