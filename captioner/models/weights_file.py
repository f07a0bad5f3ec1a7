"""A backbone's state-dict file, as `--encoder-weights PATH` names it: read safely, or refused by name.

torch's format is read with `weights_only`, so a file that would need the full unpickler is refused
and its code never runs.
"""

from __future__ import annotations

import os

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from captioner.errors import CaptionerError
from captioner.io import read_torch


def read_weights_file(path: str) -> dict[str, torch.Tensor]:
    """The tensors of a state-dict file by name (a {"state_dict": ...} wrapper is unwrapped). Raises
    CaptionerError where the file is missing, empty, truncated or corrupt, holds pickled objects (refused
    unrun), or is not a dict of tensors."""
    if not os.path.isfile(path):
        raise CaptionerError(
            f"--encoder-weights {path}: no such file (expected 'imagenet', 'none' or a path to a state dict of "
            "the --encoder backbone)"
        )
    if os.path.getsize(path) == 0:
        raise CaptionerError(f"--encoder-weights {path}: the file is empty")
    with open(path, "rb") as f:
        head = f.read(2)
    if head == b"PK" or head[:1] == b"\x80":  # torch.save's zip, or its legacy pickle format
        state = read_torch(
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
