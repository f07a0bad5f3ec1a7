"""The checkpoint format, in one place: its keys, one atomic save, one safe load, and migrations.

A checkpoint is a plain dict of tensors and Python values (never a pickled object), so
`torch.load(..., weights_only=True)` reads it and refuses anything that would run code.

    key              in        what
    format           every     "captioner-checkpoint/<version>"
    model            every     the decoder's state dict (with `fit --ema`, the weights' moving average)
    decoder          every     `DecoderConfig` as a dict
    vocab            every     the vocabulary's words, in id order
    encoder          every     `EncoderSpec` as a dict, with the fingerprint of its weights
    max_len          every     most words per caption in training
    step             every     optimizer steps so far (int)
    encoder_state    some      the encoder layers `fit --fine-tune-encoder` trained (plain tensors)
    familiarity      some      statistics of the training features (`evaluation.familiarity`)
    metrics          some      the last validation's figures, attention health included
    attention        some      whether its heatmaps are meaningful: {"meaningful", "problems", "health"}
    card             some      what a model card says (data, limits, test scores)
    command          fit's     the command line that made it
    data             fit's     {"dir", "fingerprint"} of the prepared data it was trained on
    train, progress  fit's     `TrainConfig` and `Progress` as dicts
    optimizer, scheduler, rng  fit's: the state a resumed run continues from exactly
    training_model   fit's     with `--ema`: the raw weights the optimizer steps (for `--resume`)

Older versions are brought up to date by `migrate` as they are read.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass, field

import torch

from captioner.errors import CaptionerError
from captioner.io import atomic_path
from captioner.models.decoder import AttentionDecoder, DecoderConfig
from captioner.models.encoder import EncoderSpec
from captioner.models.vocab import Vocabulary

FORMAT = "captioner-checkpoint"
VERSION = 3
REQUIRED = ("model", "decoder", "vocab", "encoder", "step")


class _Writer:
    """A file's write() that remembers the OSError it raised: torch.save reports a failed write
    (a full disk) only as RuntimeError("unexpected pos ..."), which names no cause."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


def save_checkpoint(ck: dict, path: str) -> None:
    """Write a checkpoint atomically (`captioner.io.atomic_path`): never a half-written file.

    Raises:
        OSError: the write failed (e.g. ENOSPC, a full disk); `path` is untouched.
    """
    missing = [k for k in REQUIRED if k not in ck]
    if missing:
        raise ValueError(f"a checkpoint needs {missing}")
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        writer = _Writer(f)
        try:
            torch.save({**ck, "format": f"{FORMAT}/{VERSION}"}, writer)
        except RuntimeError:
            if writer.error is not None:
                raise writer.error from None
            raise


def load_checkpoint(path: str, map_location="cpu") -> dict:
    """Read a checkpoint safely and bring it up to the current version.

    Raises:
        CaptionerError: missing file, not a checkpoint, truncated, of a newer version, or one
            that carries pickled objects (refused by weights_only; its code never runs).
    """
    if not os.path.isfile(path):
        raise CaptionerError(f"{path}: no such checkpoint file")
    if os.path.getsize(path) == 0:
        raise CaptionerError(f"{path}: the checkpoint file is empty")
    try:
        ck = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else "unsupported content"
        raise CaptionerError(
            f"{path}: refused: the file holds pickled objects that only a full "
            f"unpickler would run, not plain tensors and values ({first})"
        ) from None
    except Exception as e:  # zip/EOF errors from an empty, truncated or foreign file
        raise CaptionerError(f"{path}: not a readable checkpoint ({type(e).__name__}: {e})") from None
    return migrate(ck, path)


def migrate(ck, path: str) -> dict:
    """A checkpoint of any version, as the current version describes it.

    Before version 3, attention was trained with the half-turn equivariance term (`equivariance`
    in the training config), which the view consistency replaced: a resumed older run goes on
    with neither (`consistency` 0), as close as this version comes to how it was trained.
    """
    name, _, version = str(ck.get("format", "")).partition("/") if isinstance(ck, dict) else ("", "", "")
    if name != FORMAT or not version.isdigit():
        raise CaptionerError(f"{path}: not a captioner checkpoint (expected format {FORMAT}/<version>)")
    if int(version) > VERSION:
        raise CaptionerError(
            f"{path}: checkpoint version {version} was written by a newer captioner; "
            f"this one reads up to version {VERSION}: upgrade captioner"
        )
    missing = [k for k in REQUIRED if k not in ck]
    if missing:
        raise CaptionerError(f"{path}: checkpoint lacks {missing}")
    if int(version) < 3 and isinstance(ck.get("train"), dict):
        ck["train"].pop("equivariance", None)
        ck["train"].setdefault("consistency", 0.0)
    ck["format"] = f"{FORMAT}/{VERSION}"
    return ck


@dataclass
class Trained:
    """What inference needs from a checkpoint (or an exported model)."""

    decoder: AttentionDecoder
    vocab: Vocabulary
    encoder: EncoderSpec
    max_len: int
    step: int
    encoder_state: dict | None = None  # fine-tuned encoder layers
    familiarity: dict | None = None  # training-feature statistics, as stored
    info: dict = field(default_factory=dict)  # metrics, train, data, card, attention: as stored


def read_trained(ck: dict, source: str) -> Trained:
    """The model a checkpoint dict holds, built and loaded.

    Raises:
        CaptionerError: the weights do not fit the config, or the vocabulary or encoder spec
            is malformed (the message names `source`).
    """
    try:
        decoder = AttentionDecoder.from_config(DecoderConfig.from_dict(ck["decoder"]))
        decoder.load_state_dict(ck["model"])
        vocab = Vocabulary(ck["vocab"])
        spec = EncoderSpec.from_dict(ck["encoder"])
    except (TypeError, KeyError, RuntimeError, ValueError) as e:
        raise CaptionerError(f"{source}: the checkpoint's model does not load ({str(e).splitlines()[0]})") from None
    if decoder.config.vocab_size != len(vocab):
        raise CaptionerError(
            f"{source}: the vocabulary has {len(vocab)} words but the weights {decoder.config.vocab_size}"
        )
    info = {k: ck.get(k) or {} for k in ("metrics", "train", "data", "card", "attention")}
    return Trained(
        decoder,
        vocab,
        spec,
        max_len=int(ck.get("max_len", 20)),
        step=int(ck["step"]),
        encoder_state=ck.get("encoder_state"),
        familiarity=ck.get("familiarity"),
        info=info,
    )
