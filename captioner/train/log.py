"""A run's log and what it survives.

metrics.jsonl holds one JSON line per record; each training line, besides the losses, says what the machine did
since the last one (the host's wait for batches, the device's peak memory). `fit --tensorboard DIR` shows the records
there too (rank 0 alone, from values already on the host). A resumed run purges the events after its last.pt's step
(`purge_step`), which it takes again, so that each step is shown once; a fresh run purges what an earlier one left.

What a cluster job meets and survives: preemption and Ctrl-C (a graceful stop), a full disk (reported saves, lost
log lines), damaged features (non-finite checks), a library's warnings (into the log as fault notes).
Symbols: n words, g grid side, L = g·g locations.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np
import torch
from PIL import Image

from captioner.data.dataset import CaptionData, damaged_row_message
from captioner.data.images import load_image
from captioner.decoding.beams import Hypothesis
from captioner.errors import CaptionerError, ImageError
from captioner.evaluation.heatmaps import attention_figure, figure_png


class RunLog:
    """metrics.jsonl (rank 0): one JSON line per record, with the seconds since `started`; a full disk
    loses log lines, not the run. With a `board` (`fit --tensorboard`: `TensorBoard`),
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


EXAMPLES = 4  # validation images shown after each validation
PANEL_SIDE = 160  # longest side of each panel's image in a figure, in pixels
DPI = 64  # the figures' resolution: a panel (2.4 inches) is 154 pixels wide
FLUSH_SECONDS = 10  # how often what was written reaches the event files
MACHINE = ("load_s", "peak_gib")  # a training line's fields about the machine (`train.log`)
PLACE = ("event", "step", "epoch", "time")  # a record's fields that say where the run is, not how it does
# A validation's learning rate is the training lines' own (after the schedule's step); best.pt's step is no score.
NOT_SCORES = (*PLACE, "lr", "best_step")


def summary_writer():
    """`torch.utils.tensorboard.SummaryWriter`; CaptionerError, naming the extra that brings it, where
    tensorboard is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise CaptionerError(
            "--tensorboard needs the tensorboard package, which is not installed: pip install 'captioner[train]'"
        ) from None
    return SummaryWriter


def open_board(log_dir: str | None, *, main: bool, saved: dict | None) -> TensorBoard | None:
    """The run's board in `log_dir` (rank 0's: `main`), None without one; `saved`: a resumed run's last.pt.
    Without tensorboard installed, every rank alike raises CaptionerError before the run starts."""
    if not log_dir:
        return None
    summary_writer()  # every rank: all refuse alike
    if not main:
        return None
    return TensorBoard(log_dir, resumed_at=None if saved is None else saved["step"])


class TensorBoard:
    """The run's records as TensorBoard scalars and its validation examples as text and images; `resumed_at`: the
    step of the last.pt a resumed run starts from."""

    def __init__(self, log_dir: str, *, resumed_at: int | None):
        purge = 0 if resumed_at is None else resumed_at + 1  # events at last.pt's step are the checkpoint's own
        self.writer = summary_writer()(log_dir, purge_step=purge, flush_secs=FLUSH_SECONDS)
        self.last: tuple[int, float] | None = None  # (step, seconds) of the last record: the steps per second

    def write(self, record: dict) -> None:
        """A record of metrics.jsonl (with its "time", the run's seconds), as scalars at its step."""
        step = record.get("step")
        if step is None:
            return
        if record.get("event") == "train":
            self._train(record, step)
        elif record.get("event") == "val":
            self._validation(record, step)
        self.last = (step, record["time"])

    def _train(self, record: dict, step: int) -> None:
        for key, value in record.items():
            if key in MACHINE:
                self._scalar(f"machine/{key}", value, step)
            elif key not in PLACE:
                self._scalar(f"train/{key}", value, step)
        # Since the previous record: a validation or a note in between starts the count again.
        if self.last is not None and step > self.last[0] and record["time"] > self.last[1]:
            self._scalar("machine/steps_per_s", (step - self.last[0]) / (record["time"] - self.last[1]), step)

    def _validation(self, record: dict, step: int) -> None:
        for key, value in record.items():
            if key == "attention_health":
                for name, figure in (value or {}).items():
                    self._scalar(f"attention_health/{name}", figure, step)
            elif key not in NOT_SCORES:
                self._scalar(f"val/{key}", value, step)

    def _scalar(self, tag: str, value, step: int) -> None:
        """A number (a bool as 0 or 1); text, None and non-finite values are left out."""
        if isinstance(value, (bool, int, float)) and math.isfinite(value):
            self.writer.add_scalar(tag, float(value), step)

    def examples(self, step: int, data: CaptionData, hyps: dict[int, Hypothesis]) -> None:
        """The first `EXAMPLES` validation images of `hyps` (image id → this process's caption), by id: each
        caption as text, and its attention figure over the image where the image file is still there."""
        ids, rows = data.split_images("val")
        row_of = dict(zip(ids.tolist(), rows.tolist()))
        for image_id in sorted(hyps)[:EXAMPLES]:
            words = data.vocab.decode(hyps[image_id].tokens)
            caption, references = " ".join(words), data.references["val"].get(image_id, [])
            text = f"**{caption}**\n\nreferences:\n\n" + "\n".join(f"- {r}" for r in references)
            image, why = _image(data.path_of(row_of[image_id]))
            self.writer.add_text(f"captions/{image_id}", text + (f"\n\nno picture: {why}" if why else ""), step)
            if image is None:
                continue
            g = data.encoder.grid
            attention = np.asarray(hyps[image_id].attention, dtype=np.float32).reshape(len(words), g, g)  # (n, g, g)
            fig = attention_figure(
                image, words, attention, preprocess=data.encoder.preprocess, title=caption, panel_side=PANEL_SIDE
            )
            picture = np.asarray(Image.open(io.BytesIO(figure_png(fig, dpi=DPI))).convert("RGB"))  # (H, W, 3)
            self.writer.add_image(f"attention_maps/{image_id}", picture, step, dataformats="HWC")

    def close(self) -> None:
        self.writer.close()


def _image(path: str) -> tuple[Image.Image | None, str]:
    """The image at `path`, or None and why not (moved or deleted since `prepare`, unreadable)."""
    if not os.path.isfile(path):
        return None, f"{path} is not there"
    try:
        return load_image(path), ""
    except ImageError as e:
        return None, str(e)


# Exit status after a graceful stop: 0 for SIGTERM (the job did what a preemption notice asks: saved and
# stopped, not a failure), 130 for Ctrl-C (the shell's convention, so that `fit && evaluate` does not go on).
EXIT_STATUS = {signal.SIGTERM: 0, signal.SIGINT: 130}

logger = logging.getLogger(__name__)


def first_nonfinite(state: dict) -> str | None:
    for name, value in state.items():
        if torch.is_tensor(value) and value.is_floating_point() and not bool(torch.isfinite(value).all()):
            return name
    return None


class GracefulStop:
    """Context manager: SIGTERM and SIGINT ask for a stop at the next safe point instead of killing.

    Inside the block the first signal only sets `requested`; repeats are ignored while the code saves and returns
    (under torchrun a Ctrl-C reaches each worker twice: from the terminal and from the agent). SIGKILL and Ctrl-\\
    (SIGQUIT) still end it at once. Outside the main thread signals cannot be caught, and the block does nothing.
    `announce`: one line to stderr when a signal arrives."""

    def __init__(self, signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT), *, announce: bool = True):
        self.signals, self.announce = tuple(signals), announce
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> bool:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
        return False

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            return
        self.signum = signum
        if self.announce:
            # os.write, not print: the handler may run while the main code is inside a write to
            # stderr (the progress bar), and a buffered stream refuses a reentrant call.
            os.write(
                sys.stderr.fileno(),
                f"\n{signal.Signals(signum).name}: stopping after the current "
                "step, then saving (SIGKILL ends it at once)\n".encode(),
            )

    def request(self, signum: int = signal.SIGTERM) -> None:
        """Ask for a stop as a signal would (for callers that are not signalled, and for tests)."""
        if self.signum is None:
            self.signum = signum

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    @property
    def exit_status(self) -> int:
        return EXIT_STATUS.get(self.signum, 0)


def stop_requested(stop: GracefulStop | None) -> bool:
    return stop is not None and stop.requested


class _Forward(logging.Handler):
    """Hands each record of information or worse to a function."""

    def __init__(self, emit: Callable[[logging.LogRecord], None]):
        super().__init__(logging.INFO)
        self.emit = emit


class FaultLog:
    """One-line warnings about the faults training goes on through, on stderr and in metrics.jsonl (`write_log`);
    `show`: print warnings about shared state (rank 0 only under torchrun)."""

    def __init__(self, write_log: Callable[[dict], None], show: bool = True):
        self.write_log, self.show = write_log, show
        self.named: set[int] = set()  # feature rows already reported

    def warn(self, event: str, message: str, *, show: bool = True, local: bool = False, **fields) -> None:
        """Print "warning: <message>" (with `show`) and log {"event": event, **fields, "message": message};
        `local`: a fault this process alone met (its share of a batch), printed on every rank."""
        if show and (self.show or local):
            logger.warning(message)
        self.write_log({"event": event, **fields, "message": message})

    @contextlib.contextmanager
    def recording(self, logger: logging.Logger) -> Iterator[None]:
        """While open, `logger`'s records (a library's, shown where it logs) are also lines of the log: its
        information as "<logger>" events, its warnings as "<logger>_failed" ones ("compiled", "compiled_failed")."""
        event = logger.name.rpartition(".")[2]
        handler = _Forward(
            lambda record: self.write_log(
                {"event": event + "_failed" * (record.levelno >= logging.WARNING), "message": record.getMessage()}
            )
        )
        level = logger.level
        logger.setLevel(min(logger.getEffectiveLevel(), logging.INFO))
        logger.addHandler(handler)
        try:
            yield
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)

    def skipped_steps(self, step: int, count: int, terms: dict, scaled: bool = False) -> None:
        """Report steps not applied because a loss term or the gradient was not finite, found at `step`; `terms`: the
        means over the applied steps since the last log line. Under fp16 (`scaled`) the scaler finds its scale by
        overflowing now and then: such steps are logged but not printed."""
        shown = ", ".join(f"{k} {v:.4g}" for k, v in terms.items())
        self.warn(
            "skipped_step",
            f"step {step}: {count} step{'s' * (count > 1)} since the last log line had a loss term or gradient that "
            f"was not finite and {'were' if count > 1 else 'was'} skipped, the weights unchanged (means of the "
            f"steps applied: {shown or 'none'})",
            show=not scaled,
            step=step,
            skipped=count,
        )

    def damaged_rows(self, rows: Sequence[int], data, step: int) -> None:
        """Report the feature rows of `data` whose captions a batch left out (one per caption); each image once."""
        for row in sorted({int(r) for r in rows} - self.named):
            self.named.add(row)
            image_id, path = data.meta["image_ids"][row], data.path_of(row)
            self.warn(
                "damaged_features",
                damaged_row_message(image_id, path, row, data.cache.path, "its captions are left out of training"),
                local=True,
                step=step,
                image_id=image_id,
                file=path,
                row=row,
            )
