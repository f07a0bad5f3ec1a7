"""A VGG state-dict file, as `--encoder-weights PATH` names it: read safely, or refused by name.

torch's format (`torch.save(model.state_dict(), PATH)`, .pt/.pth) is read with `weights_only`, so a
file that would need the full unpickler is refused and its code never runs; safetensors files are
read as they are. Whether the tensors fit the architecture is `models.encoder`'s check.
"""

from __future__ import annotations

import os
import pickle

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from captioner.errors import CaptionerError


def read_weights_file(path: str) -> dict[str, torch.Tensor]:
    """The tensors of a VGG state-dict file: safetensors, or torch's format read with weights_only.

    Args:
        path: the file; torch's zip (or legacy) format is told from safetensors by its first bytes.

    Returns:
        Its tensors by name (a {"state_dict": ...} wrapper, as some trainers save, is unwrapped).

    Raises:
        CaptionerError: naming the file: missing, empty, truncated or corrupt, holding pickled
            objects (refused unrun), or not a dict of tensors.
    """
    if not os.path.isfile(path):
        raise CaptionerError(
            f"--encoder-weights {path}: no such file (expected 'imagenet', 'none' or a path to a VGG state dict)"
        )
    if os.path.getsize(path) == 0:
        raise CaptionerError(f"--encoder-weights {path}: the file is empty")
    with open(path, "rb") as f:
        head = f.read(2)
    if head == b"PK" or head[:1] == b"\x80":  # torch.save's zip, or its legacy pickle format
        state = load_torch_file(
            path,
            name=f"--encoder-weights {path}",
            kind="torch state dict",
            hint="; save the model's state_dict() instead",
        )
    else:
        try:
            state = load_file(path)
        except (SafetensorError, OSError, ValueError) as e:
            raise CaptionerError(
                f"--encoder-weights {path}: neither a torch state dict nor a readable safetensors file "
                f"(truncated or corrupt?): {e}"
            ) from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise CaptionerError(f"--encoder-weights {path}: expected a dict of tensors, got {type(state).__name__}")
    odd = next((k for k, v in state.items() if not isinstance(v, torch.Tensor)), None)
    if odd is not None:
        raise CaptionerError(
            f"--encoder-weights {path}: expected a dict of tensors, but {odd!r} is a {type(state[odd]).__name__}"
        )
    return state


def load_torch_file(path: str, *, name: str, kind: str, hint: str = "", map_location="cpu"):
    """`torch.load` with weights_only: a file that needs the full unpickler is refused, its code never run.

    Args:
        name: how messages name the file (its path, or the option that gave it).
        kind: what the file should be ("checkpoint", "torch state dict").
        hint: what to do instead, added to a refusal.

    Raises:
        CaptionerError: the file holds pickled objects, or is truncated, corrupt or not torch's format.
    """
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise CaptionerError(
            f"{name}: refused: the file holds pickled objects that only a full unpickler would run, not plain "
            f"tensors and values ({_first_line(e) or 'unsupported content'}){hint}"
        ) from None
    except Exception as e:  # zip/EOF errors from a truncated or foreign file
        raise CaptionerError(
            f"{name}: not a readable {kind}, truncated or corrupt ({type(e).__name__}: {_first_line(e)})"
        ) from None


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""
