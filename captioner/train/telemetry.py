"""What `fit`'s log says about the run besides its losses: the first line's record of the settings,
and on each training line what the machine did since the last one (the host's wait for batches, the
device's peak memory).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

import torch


def start_record(record: dict, stage, step, progress, resume: bool, data) -> dict:
    """The log's first line: the run's settled configs, as its checkpoints record them, and where it starts.

    Args:
        record, stage, step: what the run's checkpoints say of it, the `Stage` it starts in and its `TrainStep`.
    """
    d = step.d
    return {
        "event": "start",
        "step": progress.step,
        "epoch": progress.epoch,
        "resume": resume,
        "decoder": record["decoder"],
        "train": record["train"],
        "device": str(step.device),
        "world": d.world,
        "train_captions": int(len(data.lengths)),
        "batches_per_epoch": stage.source.num_batches(world=d.world),
    }


class Waits:
    """The host's seconds spent waiting for the next batch, since the last `read`: when it is a small share
    of the time between log lines, the data is not what limits training."""

    def __init__(self):
        self.seconds = 0.0

    def timed(self, batches: Iterable) -> Iterator:
        """The batches, each one's making timed."""
        it = iter(batches)
        while True:
            t0 = time.perf_counter()
            batch = next(it, None)
            self.seconds += time.perf_counter() - t0
            if batch is None:
                return
            yield batch

    def read(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return round(seconds, 3)


def machine(device: torch.device, waits: Waits) -> dict:
    """A training line's fields about the machine: `load_s` (the host's wait for batches since the last
    line), and on CUDA `peak_gib` (the most memory tensors held)."""
    fields = {"load_s": waits.read()}
    if device.type == "cuda":
        fields["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
    return fields
