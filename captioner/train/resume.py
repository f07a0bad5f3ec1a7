"""Starting from a checkpoint: `--init` and `--resume` checked against the data, a resumed run's state put back."""

from __future__ import annotations

import os

import torch

from captioner.data.dataset import CaptionData
from captioner.errors import CaptionerError
from captioner.io import read_torch
from captioner.models.checkpoint import load_checkpoint
from captioner.train import distributed, resilience
from captioner.train.checkpoints import Live, rank_streams_path
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
    _load_optimizer(live.optimizer, ck["optimizer"])
    live.scheduler.load_state_dict(ck["scheduler"])
    progress = Progress(**ck["progress"])
    if progress.cooldown_from is not None:  # this invocation has its own budget, and its own cooldown
        for group, lr in zip(live.optimizer.param_groups, progress.cooldown_from):
            group["lr"] = _rate(group["lr"], lr)
        progress.cooldown_from = None
    _restore_streams(live.generator, ck["rng"], out_dir, progress.step, notes)
    return progress


# The settings that say how this run's optimizer steps (its device, its CUDA graphs), not the saved run's.
FLAGS = ("foreach", "fused", "capturable", "differentiable")


def _load_optimizer(optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """The saved moments and learning rates, in this run's optimizer as it was made: its flags stay
    (a run saved on a CPU and resumed on a GPU stays capturable, for its graphs), and each saved rate
    goes into this run's rate (a tensor the graphs read stays that tensor)."""
    groups, rates = saved["param_groups"], [g["lr"] for g in optimizer.param_groups]
    if len(groups) == len(optimizer.param_groups):  # (else load_state_dict says what differs)
        # Given before loading: they also place the saved step counts (on the device if capturable or fused).
        ours = [{k: g[k] for k in FLAGS if k in g} for g in optimizer.param_groups]
        groups = [{**g, **flags} for g, flags in zip(groups, ours)]
    optimizer.load_state_dict({**saved, "param_groups": groups})
    for group, rate in zip(optimizer.param_groups, rates):
        group["lr"] = _rate(rate, group["lr"])


def _rate(rate, value):
    """`value` as this run holds a learning rate: written into `rate` where that is a tensor, else a float."""
    if torch.is_tensor(rate):
        return rate.copy_(value) if torch.is_tensor(value) else rate.fill_(value)
    return float(value)


def _restore_streams(generator: torch.Generator, rng: dict, out_dir: str, step: int, notes) -> None:
    """The random streams of a resumed run, each rank's its own: as saved where they fit this rank,
    device and GPU count; where they do not (another number of processes, a run saved on a GPU resumed
    on a CPU, fewer GPUs), reseeded from (seed, rank, step), with a note in the log."""
    here = distributed.current()
    rank, world = here.rank, here.world
    own, missing = _saved_streams(rng, out_dir, rank, world, step)
    seed = _seed(torch.initial_seed(), rank, step)  # the run's seed, read before a saved state replaces it
    if own is None:
        torch.default_generator.manual_seed(seed)
    else:
        torch.set_rng_state(own["torch"].cpu())
    reseeded = [missing] if missing else []
    state = own["generator"].cpu() if own is not None else None
    if state is not None and state.numel() == generator.get_state().numel():
        generator.set_state(state)
    else:
        generator.manual_seed(_seed(generator.initial_seed(), rank, step))
        if state is not None:
            reseeded.append(f"the terms' generator (saved on another kind of device, now {generator.device.type})")
    saved_cuda = own["cuda"] if own is not None else []
    here = _restore_cuda(saved_cuda, seed)
    if own is not None and len(saved_cuda) != here:
        reseeded.append(f"the CUDA streams ({len(saved_cuda)} saved, {here} GPUs here)")
    if reseeded:
        notes.warn(
            "rng_reseeded",
            f"--resume: reseeded {' and '.join(reseeded)}: the run goes on, but not with the draws it would have had",
            step=step,
            local=rank > 0 and rng.get("world", world) == world,  # this rank's own: rank 0 cannot say it
        )


def _saved_streams(rng: dict, out_dir: str, rank: int, world: int, step: int) -> tuple[dict | None, str]:
    """This rank's streams as saved (rank 0's in last.pt, each other rank's beside it), or None and why not."""
    saved_world = rng.get("world", world)  # (not recorded before each rank saved its own)
    if saved_world != world:
        return None, f"every rank's random streams (saved by {saved_world} processes, resumed by {world})"
    if rank == 0:
        return rng, ""
    path = rank_streams_path(out_dir, rank)
    try:
        own = read_torch(path, name=path, kind="random streams") if os.path.isfile(path) else {}
    except CaptionerError:  # truncated: as if it were not there
        own = {}
    if (own.get("step"), own.get("world")) != (step, world):
        return None, f"rank {rank}'s random streams ({path} holds none of step {step})"
    return own["rng"], ""


def _restore_cuda(saved: list, seed: int) -> int:
    """Each GPU's default generator as `saved`, those beyond it seeded with `seed`; returns the GPU count.

    Every call names its GPU's generator: entering a device (`torch.cuda.device`) would open a CUDA
    context on it, and so on every GPU of the machine."""
    here = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if here:
        torch.cuda.init()  # fills torch.cuda.default_generators; enters no device
    for i in range(here):
        if i < len(saved):
            torch.cuda.default_generators[i].set_state(saved[i].cpu())
        else:
            torch.cuda.default_generators[i].manual_seed(seed)
    return here


def _seed(base: int, rank: int, step: int) -> int:
    """A seed for each rank at each step of a run seeded `base`: reseeded streams differ across ranks."""
    return hash((base, rank, step)) & (2**63 - 1)


def start_from(job, data: CaptionData, device) -> tuple[dict | None, dict | None, dict]:
    """The checkpoints a run starts from (--init's, the resumed last.pt), each checked against the data, and how the
    run began as its checkpoints record it: {"init", "boxes", "command"} (a resumed run keeps its first --init and
    command line, and reads its boxes again)."""
    init, boxes, out_dir = job.init, job.boxes, job.out
    began = {"init": init, "boxes": boxes, "command": job.command}
    if not job.resume:
        return (checked_checkpoint(init, data, device, "--init") if init else None), None, began
    last = os.path.join(out_dir, "last.pt")
    saved = checked_checkpoint(last, data, device, "--resume")
    if saved["train"].get("fine_tune") and "encoder_state" not in saved:
        raise CaptionerError(f"--resume: {last} lacks the encoder_state its fine-tuning settings call for")
    trained_with = saved["data"].get("boxes")
    if bool(trained_with) != bool(boxes):
        raise CaptionerError(
            f"--resume: {last} was trained with --boxes {trained_with}: pass it again"
            if trained_with
            else f"--resume: {last} was trained without --boxes: leave it out, or start a new run from it "
            "with --init OUT/best.pt"
        )
    return None, saved, {**began, "init": saved["data"].get("init"), "command": saved.get("command")}
