"""The exported model: a folder the way models are shared, in which nothing can run code on load.

DIR/model.safetensors   tensors by prefix: "decoder.", "encoder." (fine-tuned layers),
                        "encoder_weights." (a carried weights file), "familiarity."
DIR/config.json         format and version, decoder config, encoder spec, preprocessing,
                        max_len, step, and the model's record (metrics, attention, card)
DIR/vocab.json          {"words": [...]}, in id order
DIR/README.md           the model card
"""

from __future__ import annotations

import os

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from captioner.errors import CaptionerError
from captioner.io import atomic_path, read_folder_config, read_json, write_json_atomic
from captioner.models.checkpoint import Trained, carry_encoder_weights, read_trained
from captioner.models.encoder import EncoderSpec
from captioner.models.preprocess import IMAGENET_MEAN, IMAGENET_STD

FORMAT, VERSION = "captioner-model", 2
FILES = ("model.safetensors", "config.json", "vocab.json")
RECORD = ("metrics", "attention", "card", "train", "data")  # what config.json keeps of a checkpoint's record


def write_exported(ck: dict, out_dir: str) -> None:
    ck = carry_encoder_weights(ck)  # checked before anything is written
    os.makedirs(out_dir, exist_ok=True)
    tensors = {f"decoder.{k}": v for k, v in ck["model"].items()}
    tensors |= {f"encoder.{k}": v for k, v in (ck.get("encoder_state") or {}).items()}
    tensors |= {f"encoder_weights.{k}": v for k, v in (ck.get("encoder_weights") or {}).items()}
    familiarity = dict(ck.get("familiarity") or {})
    for k in [k for k, v in familiarity.items() if torch.is_tensor(v)]:
        tensors[f"familiarity.{k}"] = familiarity.pop(k)
    with atomic_path(os.path.join(out_dir, "model.safetensors")) as tmp:
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, tmp)
    encoder, spec = ck["encoder"], EncoderSpec.from_dict(ck["encoder"])
    config = {
        "format": FORMAT,
        "version": VERSION,
        "decoder": ck["decoder"],
        "encoder": encoder,
        "preprocess": {
            "size": spec.image_size,
            "crop": spec.crop,
            "mean": list(IMAGENET_MEAN),
            "std": list(IMAGENET_STD),
        },
        "max_len": int(ck.get("max_len", 20)),
        "step": int(ck["step"]),
        "familiarity": familiarity or None,
        **{k: ck.get(k) for k in RECORD},
    }
    write_json_atomic(os.path.join(out_dir, "config.json"), config)
    write_json_atomic(os.path.join(out_dir, "vocab.json"), {"words": ck["vocab"]})


def read_exported(folder: str) -> Trained:
    """The model of an exported folder, built and loaded. Raises CaptionerError for a missing file, a config
    of another format or a newer version, a truncated or corrupt safetensors file, or weights that do not
    fit the config or the vocabulary."""
    config = read_folder_config(folder, FILES, kind="exported model", fmt=FORMAT, version=VERSION)
    words = read_json(os.path.join(folder, "vocab.json"), "vocabulary").get("words")
    tensors = _tensors(os.path.join(folder, "model.safetensors"))
    part = lambda prefix: {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
    ck = {
        "model": part("decoder."),
        "decoder": config.get("decoder"),
        "vocab": words,
        "encoder": config.get("encoder"),
        "max_len": config.get("max_len", 20),
        "step": config.get("step", 0),
        "encoder_state": part("encoder.") or None,
        "encoder_weights": part("encoder_weights.") or None,
        **{k: config.get(k) for k in RECORD},
    }
    familiarity = {**(config.get("familiarity") or {}), **part("familiarity.")}
    ck["familiarity"] = familiarity or None
    embedding = ck["model"].get("embedding.weight")
    if not isinstance(words, list) or (embedding is not None and embedding.shape[0] != len(words)):
        size = len(words) if isinstance(words, list) else "no"
        raise CaptionerError(
            f"{folder}/vocab.json: {size} words, but the weights in model.safetensors are for "
            f"{None if embedding is None else embedding.shape[0]}"
        )
    return read_trained(ck, folder)


def _tensors(path: str) -> dict[str, torch.Tensor]:
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError) as e:
        raise CaptionerError(f"{path}: not a readable safetensors file, truncated or corrupt ({e})") from None
