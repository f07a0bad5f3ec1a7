"""The checkpoint format: a plain dict of tensors and Python values (never a pickled object), so
`torch.load(..., weights_only=True)` reads it and refuses anything that would run code. Its keys
are the fields of `Checkpoint` that are not None, plus "format": "captioner-checkpoint/<version>".
A file of any earlier version is brought up to the current one on load, so every reader sees one layout.

Versions: 1 and 2 trained attention with the half-turn equivariance term, which the view consistency replaced; 3 added
the consistency and kept `train` flat; 4 groups `train` by concern and records every decoder setting; 5 keeps the loss
terms' state under "terms" (4 kept hard attention's baseline in `progress`); 6 keeps the files a run read under "data"
("init", "boxes"); 7 keeps how a process ran the run (`PROCESS`) under "process", which "checkpoints" becomes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from captioner.errors import CaptionerError
from captioner.io import atomic_path, read_torch
from captioner.models.decoder import AttentionDecoder, DecoderConfig
from captioner.models.encoder import EncoderSpec, carried_weights, from_file
from captioner.models.vocab import Vocabulary

FORMAT = "captioner-checkpoint"
VERSION = 7
REQUIRED = ("model", "decoder", "vocab", "encoder", "step")


@dataclass
class Checkpoint:
    """What a checkpoint holds (the first six: every checkpoint; the rest: as noted)."""

    model: dict  # the decoder's state dict (with `fit --ema`, the weights' moving average)
    decoder: dict  # `DecoderConfig` as a dict
    vocab: list[str]  # the vocabulary's words, in id order
    encoder: dict  # `EncoderSpec` as a dict, with the fingerprint of its weights
    max_len: int  # most words per caption in training
    step: int  # optimizer steps so far
    encoder_state: dict | None = None  # the encoder layers `fit --fine-tune-encoder` trained
    encoder_weights: dict | None = None  # the trunk of an --encoder-weights file, carried (`carry_encoder_weights`)
    familiarity: dict | None = None  # statistics of the training features (`evaluation.familiarity`)
    metrics: dict | None = None  # the last validation's figures, attention health included
    attention: dict | None = None  # whether its heatmaps are meaningful: {"meaningful", "problems", "health"}
    card: dict | None = None  # what a model card says (data, limits, test scores)
    command: str | None = None  # fit's: the command line that started the run, as typed
    data: dict | None = None  # fit's: {"dir", "fingerprint"} of its prepared data, and the "init" and "boxes" files
    train: dict | None = None  # fit's: the training config (`train.config.TrainConfig`) as a dict
    progress: dict | None = None  # fit's: `train.config.Progress` as a dict
    optimizer: dict | None = None  # fit's: the state a resumed run continues from exactly ...
    scheduler: dict | None = None
    rng: dict | None = None  # rank 0's random states {"torch", "generator", "cuda"}, and "world": its processes
    terms: dict | None = None  # fit's: the loss terms' own state, {term: {name: tensor}}
    training_model: dict | None = None  # with `--ema`: the raw weights the optimizer steps (for `--resume`)

    def to_dict(self) -> dict:
        return {k: v for k, v in ((k, getattr(self, k)) for k in self.__dataclass_fields__) if v is not None}


# The groups of the training config (version 4) and the fields of the flat one (up to 3) each took.
TRAIN_GROUPS = {
    "optim": ("batch_size", "lr", "grad_clip", "ema", "seed", "amp", "compile"),
    "schedule": ("epochs", "max_minutes", "cooldown", "patience", "metric", "val_beam_size", "val_images"),
    "checkpoints": ("checkpoint_every", "checkpoint_minutes", "log_every"),
    "terms": ("alpha_c", "consistency", "consistency_share", "boxes", "boxes_weight", "boxes_choice_weight", "paper"),
}


# What version 7 moved into "process", from the groups of version 4 to 6 that held it.
PROCESS = {
    "optim": ("shapes", "compile", "cuda_graphs"),
    "schedule": ("epochs", "max_minutes"),
    "checkpoints": ("checkpoint_every", "checkpoint_minutes", "log_every", "tensorboard"),
    "fine_tune": ("workers",),
}


def current_decoder(d: dict) -> dict:
    """A decoder config of any version, with every setting: configs from before the word query attended from h_{t-1}
    alone, and those from before `decode_sharpness` decoded with the maps as trained."""
    return {"word_query": False, "decode_sharpness": 1.0, **d}


def current_train(d: dict | None) -> dict | None:
    """A training config of any version, grouped as version 4 groups it, without the files a run read
    (`--init`, `--boxes`: not settings). A setting that a version lacks gets the value that version
    trained with: flat configs without "consistency" resume with neither attention term."""
    if not isinstance(d, dict):
        return d
    if "optim" in d:
        return _process_apart({**_without(d, "init"), "terms": _without(d.get("terms") or {}, "boxes")})
    flat = {k: v for k, v in d.items() if k not in ("equivariance", "init")}
    flat.setdefault("consistency", 0.0)
    flat.setdefault("ema", 0.0)
    flat.setdefault("boxes_choice_weight", 0.0)
    fused = flat.pop("fused", True)
    grouped = {name: {k: flat.pop(k) for k in keys if k in flat} for name, keys in TRAIN_GROUPS.items()}
    grouped["optim"]["shapes"] = "auto" if fused else "fixed"
    grouped["terms"].pop("boxes", None)
    if flat.get("fine_tune"):
        flat["fine_tune"] = {"after": 0, **flat["fine_tune"]}
    return _process_apart({**flat, **grouped})


def _process_apart(d: dict) -> dict:
    """A grouped config with how its process ran it in "process" (version 7)."""
    if "process" in d:
        return d
    d, process = dict(d), {}
    for name, keys in PROCESS.items():
        if isinstance(d.get(name), dict):
            process |= {k: d[name][k] for k in keys if k in d[name]}
            d[name] = {k: v for k, v in d[name].items() if k not in keys}
    d.pop("checkpoints", None)
    return {**d, "process": process}


def _without(d: dict, key: str) -> dict:
    return {k: v for k, v in d.items() if k != key}


def _files(ck: dict) -> dict:
    """The checkpoint's "data", with the --init and --boxes files that configs up to version 5 held."""
    data = dict(ck.get("data") or {})
    train = ck.get("train") if isinstance(ck.get("train"), dict) else {}
    data.setdefault("init", train.get("init"))
    data.setdefault("boxes", train.get("boxes", (train.get("terms") or {}).get("boxes")))
    return data


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


def save_checkpoint(ck: Checkpoint | dict, path: str) -> None:
    """Write a checkpoint atomically: never a half-written file. Raises ValueError where a required key is
    missing, OSError where the write failed (a full disk); `path` is then untouched."""
    ck = ck.to_dict() if isinstance(ck, Checkpoint) else ck
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
    """Read a checkpoint safely and bring it up to the current version. Raises CaptionerError for a missing
    file, not a checkpoint, truncated, of a newer version, or one that carries pickled objects (refused by
    weights_only; its code never runs)."""
    if not os.path.isfile(path):
        raise CaptionerError(f"{path}: no such checkpoint file")
    if os.path.getsize(path) == 0:
        raise CaptionerError(f"{path}: the checkpoint file is empty")
    return migrate(read_torch(path, name=path, kind="checkpoint", map_location=map_location), path)


def migrate(ck, path: str) -> dict:
    """A checkpoint of any version, as the current version describes it. Raises CaptionerError for one not
    captioner's, a newer version's, or one lacking a required key."""
    name, _, version = str(ck.get("format", "")).partition("/") if isinstance(ck, dict) else ("", "", "")
    if name != FORMAT or not version.isdigit():
        raise CaptionerError(f"{path}: not a captioner checkpoint (expected format {FORMAT!r}/<version>)")
    if int(version) > VERSION:
        raise CaptionerError(
            f"{path}: checkpoint version {version} was written by a newer captioner; "
            f"this one reads up to version {VERSION}: upgrade captioner"
        )
    missing = [k for k in REQUIRED if k not in ck]
    if missing:
        raise CaptionerError(f"{path}: checkpoint lacks {missing}")
    ck["decoder"] = current_decoder(ck["decoder"]) if isinstance(ck["decoder"], dict) else ck["decoder"]
    if "train" in ck:
        ck["data"] = _files(ck)
        ck["train"] = current_train(ck["train"])
    if isinstance(ck.get("progress"), dict) and "baseline" in ck["progress"]:  # up to version 4
        baseline = float(ck["progress"].pop("baseline"))
        ck.setdefault("terms", {"reinforce": {"baseline": torch.tensor(baseline)}})
    ck["format"] = f"{FORMAT}/{VERSION}"
    return ck


def carry_encoder_weights(ck: dict) -> dict:
    """A checkpoint that carries its encoder's weights file, so that it loads where the file is not.

    The spec keeps only the file's base name, so nothing names a path of the machine that made it.
    Raises CaptionerError where the file is missing, unreadable, or not the one the spec's fingerprint names."""
    spec = EncoderSpec.from_dict(ck["encoder"])
    if not from_file(spec.weights) or ck.get("encoder_weights"):
        return ck
    portable = {**ck["encoder"], "weights": os.path.basename(spec.weights)}
    return {**ck, "encoder_weights": carried_weights(spec), "encoder": portable}


@dataclass
class Trained:
    """What inference needs from a checkpoint (or an exported model)."""

    decoder: AttentionDecoder
    vocab: Vocabulary
    encoder: EncoderSpec
    max_len: int
    step: int
    encoder_state: dict | None = None  # fine-tuned encoder layers
    encoder_weights: dict | None = None  # the trunk of its --encoder-weights file, where it carries it
    familiarity: dict | None = None  # training-feature statistics, as stored
    info: dict = field(default_factory=dict)  # metrics, train, data, card, attention: as stored


def read_trained(ck: dict, source: str) -> Trained:
    """The model a checkpoint dict holds, built and loaded. Raises CaptionerError where the weights do not
    fit the config, or the vocabulary or encoder spec is malformed."""
    try:
        decoder = AttentionDecoder(DecoderConfig(**current_decoder(ck["decoder"])))
        decoder.load_state_dict(ck["model"])
        vocab = Vocabulary(ck["vocab"])
        spec = EncoderSpec.from_dict(ck["encoder"])
    except (TypeError, KeyError, RuntimeError, ValueError) as e:
        raise CaptionerError(f"{source}: the checkpoint's model does not load ({str(e).splitlines()[0]})") from None
    if decoder.config.vocab_size != len(vocab):
        raise CaptionerError(
            f"{source}: the vocabulary has {len(vocab)} words but the weights {decoder.config.vocab_size}"
        )
    info = {k: ck.get(k) or {} for k in ("metrics", "data", "card", "attention")}
    info["train"] = current_train(ck.get("train")) or {}
    return Trained(
        decoder,
        vocab,
        spec,
        max_len=int(ck.get("max_len", 20)),
        step=int(ck["step"]),
        encoder_state=ck.get("encoder_state"),
        encoder_weights=ck.get("encoder_weights"),
        familiarity=ck.get("familiarity"),
        info=info,
    )
