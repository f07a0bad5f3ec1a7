"""Running under `torchrun`: process group set-up and the few collectives training needs (gloo on CPU, NCCL on
GPU); with one process every function is a no-op, so the training code reads the same either way."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from captioner.compiled import GRAPHS
from captioner.options import choose_device


@dataclass(frozen=True)
class Dist:
    """This process's place in the job."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1


@dataclass(frozen=True)
class Process:
    """How this process runs the training, decided once: its place, its device, and the compiler's mode for
    its steps (`compiled.compile_mode`; None: eager)."""

    dist: Dist
    device: torch.device
    compiling: str | None = None

    @property
    def searches_compile(self) -> bool:
        """Validation's searches compile where the steps replay as CUDA graphs."""
        return self.compiling == GRAPHS


def current() -> Dist:
    """This process's place: in torchrun's process group once it is joined (`setup`), else alone."""
    if dist.is_available() and dist.is_initialized():
        return Dist(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))
    return Dist()


def setup(device: str = "auto") -> tuple[Dist, torch.device]:
    """Join the process group if launched by torchrun, and pick this process's device ("auto", "cpu" or "cuda").
    Under torchrun with CUDA each process takes its local GPU; processes beyond the GPUs share them through gloo (NCCL
    takes one process per GPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist(), choose_device(device)
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    dev = choose_device(device, local % gpus if gpus else local)
    shared = dev.type == "cuda" and int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > gpus
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        # Long timeout: a rank may wait at a barrier while another extracts features for hours.
        backend = "nccl" if dev.type == "cuda" and not shared else "gloo"
        dist.init_process_group(backend, timeout=timedelta(hours=12))
    return Dist(rank, world, local), dev


def cleanup() -> None:
    """Leave the process group together: a rank that destroys it while another still talks to it
    can abort in gloo's threads ("terminate called without an active exception")."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def barrier(d: Dist) -> None:
    if d.active:
        dist.barrier()


def all_sum(d: Dist, values: list[float], device: torch.device) -> list[float]:
    if not d.active:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def any_true(d: Dist, flag: bool, device: torch.device) -> bool:
    """True on every process if it is true on any (e.g. one ran out of time)."""
    return all_sum(d, [float(flag)], device)[0] > 0 if d.active else flag


def gather_dicts(d: Dist, part: dict) -> dict:
    """Merge every process's dict on all processes; equal keys (e.g. image ids) are deduplicated."""
    if not d.active:
        return dict(part)
    parts = [None] * d.world
    dist.all_gather_object(parts, part)
    merged = {}
    for p in parts:
        merged.update(p)
    return merged


def broadcast(d: Dist, obj):
    if not d.active:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
