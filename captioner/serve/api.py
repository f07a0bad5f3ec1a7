"""The Python API: `Captioner.load(checkpoint).caption(image)` → words with their attention maps."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from PIL import Image

from captioner.compiled import earns_back, search_compiles
from captioner.data.images import load_image
from captioner.decoding.decode import decode, generator_for
from captioner.decoding.settings import Decoding
from captioner.evaluation.familiarity import FamiliarityStats, familiarity
from captioner.models.checkpoint import Trained
from captioner.models.encoder import rebuild_encoder
from captioner.models.fast_encoder import optimize_encoder
from captioner.models.hub import load_trained, resolve
from captioner.models.preprocess import Preprocess
from captioner.serve.caption import Caption, CaptionModel, captions
from captioner.serve.onnx_runtime import OnnxCaptioner, on_onnx

__all__ = ["Caption", "CaptionModel", "Captioner"]


class Captioner(CaptionModel):
    """A trained captioning model with its encoder on PyTorch. Shapes: B images, S the encoder's input side,
    L locations, D feature size."""

    def __init__(
        self,
        trained: Trained,
        *,
        encoder: torch.nn.Module | None = None,
        info: dict | None = None,
        device: str | torch.device = "cpu",
        fast: bool = True,
        graphs: bool = True,
    ):
        self.device = torch.device(device)
        self.encoder_state = trained.encoder_state  # fine-tuned encoder layers (checkpoint "encoder_state"), if any
        self.encoder_weights = trained.encoder_weights  # the trunk of its --encoder-weights file, where carried
        self.decoder = trained.decoder.to(self.device).eval()
        self.vocab, self.encoder_spec = trained.vocab, trained.encoder
        self.max_len, self.step = trained.max_len, trained.step
        self.fast, self.graphs = fast, graphs
        self.compiling = False  # searches run compiled (`compile_search`)
        self.encoder = self._ready(encoder) if encoder is not None else None
        self.info = info or trained.info
        self.familiarity = FamiliarityStats.from_dict(trained.familiarity)

    def _ready(self, encoder: torch.nn.Module) -> torch.nn.Module:
        # The encoder's weights are final here: make it fast for inference (same features).
        if self.fast:
            return optimize_encoder(encoder, self.device, image_size=self.encoder_spec.image_size)
        return encoder.to(self.device).eval()

    @property
    def preprocess(self) -> Preprocess:
        return self.encoder_spec.preprocess

    @property
    def attention_type(self) -> str:
        return self.decoder.config.attention

    @classmethod
    def load(
        cls,
        source: str,
        *,
        device: str = "cpu",
        build_encoder: bool = True,
        fast: bool = True,
        graphs: bool = True,
        runtime: str = "auto",
    ) -> CaptionModel:
        """Load a model: a checkpoint written by `fit`, an exported folder, a pinned URL of either, or
        hf://ORG/NAME[@REVISION]; nothing is unpickled. A folder of ONNX graphs loads onto onnxruntime as an
        `OnnxCaptioner`, and the other arguments do not apply; runtime "torch" skips that check (a caller that
        has checked the source). Without `build_encoder` the encoder is built when first needed (cached
        features need none). Raises CaptionerError when the model cannot be found, fetched or read."""
        path = resolve(source)
        if runtime != "torch" and on_onnx(path, runtime):
            return OnnxCaptioner.load(path)
        trained = load_trained(path)
        carried = trained.encoder_weights
        encoder = rebuild_encoder(trained.encoder, trained.encoder_state, source, carried)[0] if build_encoder else None
        info = {
            **trained.info,
            "checkpoint": source if "://" in source else os.path.abspath(source),
            "step": trained.step,
            "fine_tune": trained.info["train"].get("fine_tune"),
        }
        return cls(trained, encoder=encoder, info=info, device=device, fast=fast, graphs=graphs)

    def compile_search(self, batch_sizes: Sequence[int] = (), decodings: Sequence[Decoding] = (Decoding(),)) -> float:
        """From here on, on a GPU (with `graphs`), search compiled and replayed as CUDA graphs; compile now for
        each of `batch_sizes` under each of `decodings`, and return the seconds that took. PyTorch keeps CUDA
        graphs per thread: call it on the thread that will search."""
        self.compiling = search_compiles(self.device, self.graphs)
        if not (self.compiling and batch_sizes):
            return 0.0
        began = time.monotonic()
        D, grid = self.decoder.config.encoder_dim, self.encoder_spec.grid
        widest = sorted(decodings, key=lambda settings: -settings.beam_size)
        with torch.inference_mode():  # the largest search first: it sizes the static buffers, which then stay put
            for b in sorted({_padded_size(b) for b in batch_sizes}, reverse=True):
                feats = torch.zeros(b, grid * grid, D, device=self.device)  # (b, L, D)
                for settings in widest:
                    if settings.how.compiles:
                        decode(self.decoder, feats, settings, max_len=self.max_len, compiled=True)
        return time.monotonic() - began

    def _inputs(self, images: Sequence) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """Images → the encoder's inputs (B, 3, S, S) and the upright images' sizes. On a GPU the pixels go
        there as they are, one page-locked copy per image size, and are resized there; elsewhere Pillow
        resizes them, as `prepare` does."""
        pils = [load_image(Image.fromarray(im) if isinstance(im, np.ndarray) else im) for im in images]
        preprocess = self.encoder_spec.preprocess
        if self.device.type != "cuda":
            return torch.stack([preprocess(p) for p in pils]), [p.size for p in pils]  # (B, 3, S, S)
        by_size: dict[tuple[int, int], list[int]] = {}
        for i, p in enumerate(pils):
            by_size.setdefault(p.size, []).append(i)
        rows: list[torch.Tensor] = [None] * len(pils)
        for (w, h), which in by_size.items():
            host = torch.empty((len(which), h, w, 3), dtype=torch.uint8, pin_memory=True)  # (n, H, W, 3)
            for j, i in enumerate(which):
                host[j].numpy()[...] = np.asarray(pils[i])
            for i, x in zip(which, preprocess.pixels(host.to(self.device, non_blocking=True))):
                rows[i] = x  # (3, S, S)
        return torch.stack(rows), [p.size for p in pils]  # (B, 3, S, S)

    @torch.inference_mode()
    def encode(self, images: Sequence) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """Images (paths, bytes, PIL or HxWxC arrays) → features (B, L, D) and their sizes."""
        x, sizes = self._inputs(images)
        return self._features(x), sizes

    def _features(self, x: torch.Tensor) -> torch.Tensor:
        if self.encoder is None:
            built = rebuild_encoder(self.encoder_spec, self.encoder_state, "this checkpoint", self.encoder_weights)[0]
            self.encoder = self._ready(built)
        return self.encoder(x.to(self.device, non_blocking=True))  # (B, L, D)

    @torch.inference_mode()
    def caption_batch(
        self,
        images: Sequence,
        beam_size: int | None = None,
        *,
        batch_size: int = 16,
        decoding: Decoding | None = None,
        **settings,
    ) -> list[Caption]:
        """Caption several images (paths, bytes, PIL images or HxWxC uint8 arrays), a chunk at a time: one
        caption each, the best beam, or the first of its n samples with all of them in `samples`. `settings` are
        any of `Decoding`'s fields, which change `decoding`: max_len, length_norm, mode, seed, sharpness;
        method="sampling" with temperature, top_k, top_p and n. The same images, settings and seed give the
        same captions. Raises ImageError for an image that cannot be read (the message says which and why),
        OptionError for a setting that does not exist or is out of range."""
        settings = (decoding or Decoding()).with_settings(beam_size=beam_size, **settings)
        if earns_back(-(-len(images) // batch_size)):
            self.compile_search()
        generator = generator_for(settings, self.device)
        chunks = [images[i : i + batch_size] for i in range(0, len(images), batch_size)]
        if len(chunks) == 1:
            return self._captions(*self._inputs(chunks[0]), settings, generator)
        out = []
        # A thread decodes and preprocesses the next chunk while the model works on this one.
        with ThreadPoolExecutor(max_workers=1) as pool:
            ahead = pool.submit(self._inputs, chunks[0])
            for k in range(len(chunks)):
                x, sizes = ahead.result()
                if k + 1 < len(chunks):
                    ahead = pool.submit(self._inputs, chunks[k + 1])
                out += self._captions(x, sizes, settings, generator)
        return out

    def _captions(self, x: torch.Tensor, sizes: list, settings: Decoding, generator) -> list[Caption]:
        feats = self._features(x)  # (b, L, D)
        verdicts = familiarity(feats, self.familiarity)  # is each image like the training ones?
        compiled = self.compiling and settings.how.compiles
        searched = _padded(feats) if compiled else feats
        found = decode(self.decoder, searched, settings, max_len=self.max_len, generator=generator, compiled=compiled)
        return captions(found, self.vocab, self.encoder_spec.grid, settings, sizes, verdicts)


def _padded_size(b: int) -> int:
    return 1 << (b - 1).bit_length()


def _padded(feats: torch.Tensor) -> torch.Tensor:
    """A batch padded to a power of two by repeating its last image, so that searches of batches of any
    size (the demo's batcher makes them) share a few compiles; the padding's captions are dropped."""
    b, size = feats.size(0), _padded_size(feats.size(0))
    return torch.cat([feats, feats[-1:].expand(size - b, -1, -1)]) if size > b else feats  # (size, L, D)
