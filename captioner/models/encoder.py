"""The encoder: image (B, 3, S, S) → annotation vectors (B, L, D) (paper §3.1.1); VGG16 at 224:
L = 196 = 14×14, D = 512; ResNet at 256: L = 196, D = 2048.

Its `EncoderSpec` travels with the feature cache and every checkpoint, with a fingerprint of the
weights, so inference rebuilds exactly the encoder that made the training features. Random weights
(`none`) come from NumPy's legacy `RandomState(seed)`, a stream NumPy keeps fixed across releases
(torch's layer initialisation may change between versions).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import asdict, dataclass, replace
from typing import Annotated, Literal

import numpy as np
import safetensors.torch
import torch
from torch import nn

from captioner.errors import CaptionerError
from captioner.io import atomic_path
from captioner.models.backbones import (
    ARCH_HELP,
    BACKBONES,
    backbone,
    layer_index,
    layer_names,
    meta_trunk,
    seed_trunk,
    trunk_shapes,
)
from captioner.models.preprocess import Preprocess
from captioner.models.weights_file import read_weights_file

Arch = Literal[tuple(BACKBONES)]  # --encoder's choices: the table's rows


@dataclass(frozen=True)
class EncoderSpec:
    """The encoder; everything needed to rebuild it and its preprocessing."""

    arch: Annotated[Arch, "--encoder", "the backbone: " + ARCH_HELP] = "vgg16"
    weights: Annotated[
        str,
        "--encoder-weights",
        "imagenet (torchvision's, through its download cache), none "
        "(random, seeded: offline tests and demos) or a path to a state dict of the --encoder backbone",
    ] = "imagenet"
    seed: Annotated[int, "--encoder-seed", "seed of --encoder-weights none"] = 0
    image_size: Annotated[
        int | None,
        "side of the square encoder input (default: the backbone's: 224 for VGG, whose 14x14 grid it gives; "
        "256 for ResNet, as in sgrvinod's tutorial)",
    ] = None
    crop: Annotated[
        bool, "resize-256/centre-crop-224 as in the paper instead of resizing the whole image to 224x224"
    ] = False
    fingerprint: str = ""  # sha256 prefix of the weights, filled in by `build_encoder`

    def __post_init__(self):
        if self.image_size is None:  # settled here, once: the spec travels with its size
            object.__setattr__(self, "image_size", backbone(self.arch).input_size)

    @property
    def preprocess(self) -> Preprocess:
        return Preprocess(size=self.image_size, crop=self.crop)

    @property
    def grid(self) -> int:
        """The side of the attention grid (VGG16 at 224: 14, its four 2×2 poolings; ResNet: 14, pooled)."""
        return backbone(self.arch).grid(self.image_size)

    @property
    def channels(self) -> int:
        """D, the size of an annotation vector."""
        return backbone(self.arch).channels

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> EncoderSpec:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


class Encoder(nn.Module):
    """A backbone's trunk (`models.backbones`), its last map flattened to annotation vectors."""

    def __init__(self, features: nn.Sequential):
        super().__init__()
        self.features = features

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        f = self.features(images)  # (B, D, g, g): VGG's conv5 map, ResNet's pooled to the grid
        return f.flatten(2).transpose(1, 2)  # (B, L, D): location i = row * g + col


def _imagenet_state(arch: str) -> dict:
    row = backbone(arch)
    weights = row.weights
    fname = os.path.basename(weights.url)
    target = os.path.join(torch.hub.get_dir(), "checkpoints", fname)
    try:
        return weights.get_state_dict(progress=True, check_hash=True)
    except Exception as e:  # urllib errors, hash mismatch, partial file: all mean "not available"
        raise CaptionerError(
            f"cannot get the ImageNet weights for {arch} ({weights.url}): {e}.\n"
            f"Offline? Download that file elsewhere and put it at {target} "
            f"(torch's hub cache; TORCH_HOME moves it), or pass --encoder-weights PATH to a {row.name} "
            "state dict, or --encoder-weights none for a random seeded encoder."
        ) from None


def _trunk_of(arch: str, state: dict) -> dict:
    """The trunk's tensors of a state dict: the whole model's ("features.0.weight", "layer1.0.conv1.weight")
    or the trunk's alone ("0.weight"), under the trunk's names; the head's are left out."""
    prefix, names = backbone(arch).prefix, set(layer_names(arch))
    return {
        k.removeprefix(prefix) if prefix and k.startswith(prefix) else k: v
        for k, v in state.items()
        if (prefix and k.startswith(prefix)) or k.split(".")[0] in names
    }


def _fits(arch: str, state: dict) -> bool:
    """Whether a state dict holds `arch`'s trunk: every tensor of its shape, and none it lacks."""
    trunk, wanted = _trunk_of(arch, state), trunk_shapes(arch)
    return set(trunk) <= set(wanted) and all(
        k in trunk and tuple(trunk[k].shape) == shape for k, shape in wanted.items() if _required(k)
    )


def _other_arch(arch: str, state: dict) -> str:
    other = next((a for a in BACKBONES if a != arch and _fits(a, state)), None)
    return f"; it fits {other}: pass --encoder {other}" if other else ""


def _required(key: str) -> bool:
    # Files saved before BatchNorm counted its batches lack the count; loading starts it at 0.
    return not key.endswith("num_batches_tracked")


def _load_features(features: nn.Sequential, state: dict, source: str, arch: str) -> None:
    """Load a state dict's trunk into `features`; one that does not fit is refused by its first wrong key."""
    row = backbone(arch)
    trunk, wrong = _trunk_of(arch, state), f"{source}: not a {row.name} state dict"
    own = features.state_dict()
    for k, v in own.items():
        name = f"{row.prefix}{k}"
        if k not in trunk and _required(k):
            held = ", ".join(list(state)[:3]) + (", ..." if len(state) > 3 else "")
            raise CaptionerError(
                f"{wrong}: it lacks {name} (it holds {len(state)} tensors: {held}){_other_arch(arch, state)}"
            )
        if k in trunk and tuple(trunk[k].shape) != tuple(v.shape):
            raise CaptionerError(
                f"{wrong}: its {name} is {tuple(trunk[k].shape)}, {row.name}'s is {tuple(v.shape)}"
                f"{_other_arch(arch, state)}"
            )
        if k in trunk and v.is_floating_point() and not trunk[k].is_floating_point():
            raise CaptionerError(f"{source}: its {name} holds {trunk[k].dtype}, not floating-point weights")
    extra = next((k for k in trunk if k not in own), None)
    if extra is not None:
        raise CaptionerError(f"{wrong}: it holds {row.prefix}{extra}, which {row.name} lacks{_other_arch(arch, state)}")
    loaded = {k: trunk[k].to(v.dtype, copy=True) if k in trunk else torch.zeros_like(v) for k, v in own.items()}
    features.load_state_dict(loaded, assign=True)


def fingerprint(module: nn.Module) -> str:
    """A short sha256 of a module's parameters, in order."""
    h = hashlib.sha256()
    for name, t in module.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().to(torch.float32).contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def build_encoder(spec: EncoderSpec, carried: dict | None = None) -> tuple[Encoder, EncoderSpec]:
    """The encoder in eval mode, and the spec with its fingerprint filled in.

    `carried`, for weights from a file: the trunk a checkpoint or exported model carries in its place
    (`carried_weights`); the file itself is then not read. Raises CaptionerError for an unknown arch, weights
    unreachable or unreadable, or a fingerprint other than the spec's (the features were made by another encoder)."""
    trunk = meta_trunk(spec.arch).to_empty(device="cpu")
    if spec.weights == "none":
        seed_trunk(trunk, spec.seed, spec.arch)
    elif spec.weights == "imagenet":
        _load_features(trunk, _imagenet_state(spec.arch), f"ImageNet {spec.arch} weights", spec.arch)
    elif carried is not None:
        _load_features(trunk, _completed(spec.arch, carried), f"the weights carried for {spec.weights}", spec.arch)
    else:
        _load_features(trunk, read_weights_file(spec.weights), f"--encoder-weights {spec.weights}", spec.arch)
    encoder = Encoder(trunk).eval().requires_grad_(False)
    fp = fingerprint(encoder)
    if spec.fingerprint and spec.fingerprint != fp and carried is not None and REGENERATED in carried:
        _load_features(trunk, _completed(spec.arch, carried, cached=False), spec.weights, spec.arch)  # not the copy
        fp = fingerprint(encoder)
        if fp == spec.fingerprint:
            return encoder, spec
        seed, bits = carried[REGENERATED].tolist()
        raise CaptionerError(
            f"the encoder rebuilt for {spec.weights!r} has fingerprint {fp}, not {spec.fingerprint}: the layers "
            f"the model does not carry are regenerated from NumPy's RandomState({seed}) in {bits}-bit floats, and "
            f"NumPy {np.__version__} drew other numbers here; load the model with the NumPy it was made with"
        )
    if spec.fingerprint and spec.fingerprint != fp:
        raise CaptionerError(
            f"the encoder built from {spec.weights!r} ({spec.arch}, seed {spec.seed}) has fingerprint "
            f"{fp}, but the features were made by an encoder with fingerprint {spec.fingerprint}; "
            "use the same --encoder/--encoder-weights as at prepare time"
        )
    return encoder, replace(spec, fingerprint=fp)


def apply_encoder_state(encoder: Encoder, state: dict, source: str) -> Encoder:
    """Put fine-tuned layers into a built encoder (before any inference optimisation), in place.

    `state` is a checkpoint's "encoder_state": plain tensors under the names of `Encoder.features`'
    state dict ("24.weight", "layer4.0.conv1.weight", ...). Raises CaptionerError where the state names
    layers this encoder lacks or has tensors of other shapes."""
    own = encoder.features.state_dict()
    if not isinstance(state, dict) or not state or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CaptionerError(f"{source}: 'encoder_state' must be a non-empty dict of tensors")
    unknown = [k for k in state if k not in own]
    if unknown:
        raise CaptionerError(f"{source}: its encoder_state names layers this encoder lacks ({unknown[:3]})")
    wrong = [k for k, v in state.items() if v.shape != own[k].shape]
    if wrong:
        k = wrong[0]
        raise CaptionerError(
            f"{source}: its encoder_state's {k} is {tuple(state[k].shape)}, the encoder's is {tuple(own[k].shape)}"
        )
    encoder.features.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items()}, strict=False)
    return encoder


def rebuild_encoder(
    spec: EncoderSpec, encoder_state: dict | None, source: str, carried: dict | None = None
) -> tuple[Encoder, EncoderSpec]:
    """A checkpoint's image encoder: the spec's weights (or those it carries), then its fine-tuned layers if any.
    Raises CaptionerError where the spec's weights cannot be had here, or the layers do not fit."""
    try:
        encoder, spec = build_encoder(spec, carried)
    except CaptionerError as e:
        raise CaptionerError(f"{source}: cannot rebuild its image encoder: {e}") from None
    if encoder_state is not None:
        apply_encoder_state(encoder, encoder_state, source)
    return encoder, spec


def from_file(weights: str) -> bool:
    return weights not in ("imagenet", "none")


def carried_weights(spec: EncoderSpec) -> dict[str, torch.Tensor]:
    """The trunk of a spec's weights file, for a checkpoint or exported model to carry in its place.

    Layers equal to the seeded random encoder's (`--encoder-weights none` at the spec's seed, rounded to
    fp16 or not) are left out and rebuilt from that seed at load: the demo model's conv1-4, which
    its pretraining left random. REGENERATED then says how ([seed, 16 or 32]); the fingerprint
    checked at load makes the rebuilt encoder exactly the file's.

    Each floating-point tensor is in fp16 where that loses nothing (the file was fp16), else fp32, so
    the rebuilt encoder has the same fingerprint. Raises CaptionerError where the file is missing,
    unreadable or not the one the spec's fingerprint names."""
    encoder, _ = build_encoder(spec)
    out = {}
    for k, v in encoder.features.state_dict().items():
        half = v.half() if v.is_floating_point() else v
        out[k] = half if torch.equal(half.to(v.dtype), v) else v.clone()
    seeded = _seeded_state(spec.arch, spec.seed)
    for bits in (16, 32):
        same = [
            k for k, v in out.items() if v.is_floating_point() and torch.equal(v.float(), _rounded(seeded[k], bits))
        ]
        if any(k.endswith("weight") for k in same):
            return {k: v for k, v in out.items() if k not in same} | {REGENERATED: torch.tensor([spec.seed, bits])}
    return out


REGENERATED = "regenerated"  # carried weights' key: [seed, bits] of the seeded layers left out


def _seeded_state(arch: str, seed: int, layers: int | None = None) -> dict[str, torch.Tensor]:
    """The trunk state dict of the seeded random encoder (its first `layers` layers drawn, the rest empty)."""
    trunk = meta_trunk(arch).to_empty(device="cpu")
    seed_trunk(trunk, seed, arch, layers)
    return trunk.state_dict()


def _rounded(t: torch.Tensor, bits: int) -> torch.Tensor:
    return t.half().float() if bits == 16 else t


def _completed(arch: str, carried: dict, cached: bool = True) -> dict:
    """Carried weights with the layers they leave out (`REGENERATED`) drawn again from their seed, or
    read from the copy the first drawing left in torch's hub directory (`cached`: drawing them takes
    longer than the rest of loading a model)."""
    if REGENERATED not in carried:
        return carried
    seed, bits = carried[REGENERATED].tolist()
    missing = [k for k in trunk_shapes(arch) if k not in carried]
    layers = 1 + max((layer_index(k) for k in missing), default=-1)
    path = os.path.join(torch.hub.get_dir(), "captioner", f"{arch}-seed{seed}-{layers}-layers-fp{bits}.safetensors")
    seeded = _read_cached(path) if cached else None
    if seeded is None or not all(k in seeded for k in missing):
        state = _seeded_state(arch, seed, layers)
        seeded = {k: _rounded(state[k], bits) for k in missing}
        _write_cached(path, seeded)
    return {k: seeded[k] for k in missing} | {k: v for k, v in carried.items() if k != REGENERATED}


def _read_cached(path: str) -> dict | None:
    try:
        return safetensors.torch.load_file(path)
    except Exception:  # noqa: BLE001 - missing or damaged: drawn again (the model's fingerprint checks the result)
        return None


def _write_cached(path: str, state: dict) -> None:
    try:
        with atomic_path(path) as tmp:
            safetensors.torch.save_file({k: v.contiguous() for k, v in state.items()}, tmp)
    except OSError:
        pass  # a read-only home: drawn at every load


def layer_input_shape(spec: EncoderSpec, start: int) -> tuple[int, int]:
    """(L, D) of the map the trunk's layer `start` reads: the rows of the cache that fine-tuning from
    there reads (VGG16's pool4 at 224: (196, 512); ResNet's conv4_x at 256: (256, 1024))."""
    x = torch.empty(1, 3, spec.image_size, spec.image_size, device="meta")  # (1, 3, S, S)
    f = meta_trunk(spec.arch)[:start](x)  # (1, D, h, w)
    return f.shape[2] * f.shape[3], f.shape[1]
