"""Resuming and starting from a checkpoint: `--init` and `--resume` checked against the data, and a
resumed run's state put back into its live objects (`train.checkpoints.Live`).
"""

from __future__ import annotations

import os

import torch

from captioner.data.dataset import CaptionData
from captioner.errors import CaptionerError
from captioner.models.checkpoint import load_checkpoint
from captioner.train import resilience
from captioner.train.checkpoints import Live
from captioner.train.config import Progress


def checked_checkpoint(path: str, data: CaptionData, device: torch.device, flag: str) -> dict:
    """The checkpoint of --init or --resume, refused unless it was trained on this data's vocabulary and encoder."""
    try:
        ck = load_checkpoint(path, map_location=device)
    except CaptionerError as e:
        raise CaptionerError(f"{flag}: {e}") from None
    if ck["vocab"] != data.vocab.words:
        raise CaptionerError(
            f"{flag}: {path} has a vocabulary of {len(ck['vocab'])} words that differs from {data.dir}'s "
            f"({len(data.vocab)} words); start from a model trained on this data"
        )
    fingerprint = (ck.get("data") or {}).get("fingerprint") or ck["encoder"].get("fingerprint", "")
    if fingerprint != data.encoder.fingerprint:
        raise CaptionerError(
            f"{flag}: {path} was trained on features of encoder {fingerprint}, but {data.dir} holds features "
            f"of encoder {data.encoder.fingerprint}"
        )
    return ck


def restore(live: Live, ck: dict, out_dir: str, notes: resilience.FaultLog) -> Progress:
    """Put a resumed run's saved state back: weights, optimizer, schedule, random streams; its progress."""
    live.decoder.load_state_dict(ck.get("training_model", ck["model"]))
    if live.average:
        live.average.load_state_dict(ck["model"])
    if live.tuning is not None:
        live.tuning.encoder.load_encoder_state(ck["encoder_state"], os.path.join(out_dir, "last.pt"))
    live.optimizer.load_state_dict(ck["optimizer"])
    live.scheduler.load_state_dict(ck["scheduler"])
    progress = Progress(**ck["progress"])
    if progress.cooldown_from is not None:  # this invocation has its own budget, and its own cooldown
        for group, lr in zip(live.optimizer.param_groups, progress.cooldown_from):
            group["lr"] = lr
        progress.cooldown_from = None
    _restore_streams(live.generator, ck["rng"], progress.step, notes)
    return progress


def _restore_streams(generator: torch.Generator, rng: dict, step: int, notes: resilience.FaultLog) -> None:
    """The random streams of a resumed run: as saved where they fit this device and GPU count; where
    they do not (a run saved on a GPU resumed on a CPU, or on fewer GPUs), reseeded from the step,
    with a note in the log."""
    torch.set_rng_state(rng["torch"].cpu())
    reseeded = []
    state = rng["generator"].cpu()
    if state.numel() == generator.get_state().numel():
        generator.set_state(state)
    else:
        generator.manual_seed(int(generator.initial_seed()) + step)
        reseeded.append(f"the terms' generator (saved on another kind of device, now {generator.device.type})")
    saved_cuda, here = rng["cuda"], torch.cuda.device_count() if torch.cuda.is_available() else 0
    for i, s in enumerate(saved_cuda[:here]):
        torch.cuda.set_rng_state(s.cpu(), i)
    for i in range(len(saved_cuda), here):
        with torch.cuda.device(i):
            torch.cuda.manual_seed(torch.initial_seed() + step)
    if len(saved_cuda) != here:
        reseeded.append(f"the CUDA streams ({len(saved_cuda)} saved, {here} GPUs here)")
    if reseeded:
        notes.warn(
            "rng_reseeded",
            f"--resume: reseeded {' and '.join(reseeded)}: the run goes on, but not with the draws it would have had",
            step=step,
        )


def start_from(data: CaptionData, out_dir: str, init: str | None, resume: bool, device) -> tuple:
    """The checkpoints a run starts from: (--init's, the resumed last.pt), each checked against the data
    (`train.settle` checks the options against them)."""
    if resume:
        last = os.path.join(out_dir, "last.pt")
        saved = checked_checkpoint(last, data, device, "--resume")
        if saved["train"].get("fine_tune") and "encoder_state" not in saved:
            raise CaptionerError(f"--resume: {last} lacks the encoder_state its fine-tuning settings call for")
        return None, saved
    return (checked_checkpoint(init, data, device, "--init") if init else None), None
