"""Checkpoints: plain dicts of tensors and Python values, written atomically, read with weights_only.

A checkpoint holds the decoder's state dict and config, the vocabulary, the encoder spec and
preprocessing, training progress (step, epoch, optimizer, scheduler, RNG states) and metrics.
Nothing is pickled as an object, so `torch.load(..., weights_only=True)` reads it and refuses
anything that would run code.
"""
from __future__ import annotations

import os
import pickle

import torch

from .errors import CaptionerError

FORMAT = "captioner-checkpoint/1"
REQUIRED = ("format", "model", "decoder", "vocab", "encoder", "step")


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


def save_checkpoint(obj: dict, path: str) -> None:
    """Write to a temporary file beside `path`, fsync, then rename: never a half-written file.

    Raises:
        OSError: the write failed (e.g. ENOSPC, a full disk); `path` is untouched and the
            temporary file is removed.
    """
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = os.path.join(d, f".{os.path.basename(path)}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            writer = _Writer(f)
            try:
                torch.save({"format": FORMAT, **obj}, writer)
            except RuntimeError:
                if writer.error is not None:
                    raise writer.error from None
                raise
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load_checkpoint(path: str, map_location="cpu") -> dict:
    """Read a checkpoint safely.

    Raises:
        CaptionerError: missing file, not a checkpoint, truncated, or one that carries pickled
            objects (refused by weights_only; its code never runs).
    """
    if not os.path.isfile(path):
        raise CaptionerError(f"{path}: no such checkpoint file")
    if os.path.getsize(path) == 0:
        raise CaptionerError(f"{path}: the checkpoint file is empty")
    try:
        ck = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else "unsupported content"
        raise CaptionerError(f"{path}: refused: the file holds pickled objects that only a full "
                             f"unpickler would run, not plain tensors and values ({first})") from None
    except Exception as e:  # zip/EOF errors from a truncated or foreign file
        raise CaptionerError(f"{path}: not a readable checkpoint ({type(e).__name__}: {e})") from None
    if not isinstance(ck, dict) or ck.get("format") != FORMAT:
        raise CaptionerError(f"{path}: not a captioner checkpoint (expected format {FORMAT!r})")
    missing = [k for k in REQUIRED if k not in ck]
    if missing:
        raise CaptionerError(f"{path}: checkpoint lacks {missing}")
    return ck
