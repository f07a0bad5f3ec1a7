"""A run's log, metrics.jsonl: one JSON line per record; on each training line, besides the losses, what the
machine did since the last one (the host's wait for batches, the device's peak memory)."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterable, Iterator

import torch


class RunLog:
    """metrics.jsonl (rank 0): one JSON line per record, with the seconds since `started`; a full disk
    loses log lines, not the run. With a `board` (`fit --tensorboard`: `train.tensorboard.TensorBoard`),
    each record also goes there, and so do the validation's examples."""

    def __init__(self, out_dir: str, *, main: bool, started: float, board=None):
        self.main, self.started, self.file, self.board = main, started, None, board if main else None
        if main:
            os.makedirs(out_dir, exist_ok=True)
            self.file = open(os.path.join(out_dir, "metrics.jsonl"), "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        if self.file is None:
            return
        record = {**record, "time": round(time.monotonic() - self.started, 2)}
        try:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        except OSError:
            pass
        if self.board is not None:
            with contextlib.suppress(OSError):  # a full disk loses what the board shows, not the run
                self.board.write(record)

    def examples(self, step: int, data, hyps: dict) -> None:
        """A validation's captions (image id → this process's `Hypothesis`) at `step`, shown on the board."""
        if self.board is not None:
            with contextlib.suppress(OSError):
                self.board.examples(step, data, hyps)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.board is not None:
            self.board.close()


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
