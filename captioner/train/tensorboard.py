"""`fit --tensorboard DIR`: the run's log, also as TensorBoard event files in DIR, written by rank 0 alone.

The board gets every record of metrics.jsonl, whose values are already on the host, so it reads nothing from the
device. After each validation it also shows the first few of rank 0's validation images, the same each time: the
caption as text and the attention figure as `captioner caption --figures` draws it. A resumed run purges the events
after its last.pt's step (`purge_step`), which the run that stopped wrote and it takes again, so that each step is
shown once; a fresh run purges whatever an earlier run left in DIR.
Symbols: n words, g grid side, L = g·g locations.
"""

from __future__ import annotations

import io
import math
import os

import numpy as np
from PIL import Image

from captioner.data.dataset import CaptionData
from captioner.data.images import load_image
from captioner.decoding.beams import Hypothesis
from captioner.errors import CaptionerError, ImageError
from captioner.evaluation.heatmaps import attention_figure, figure_png

EXAMPLES = 4  # validation images shown after each validation
PANEL_SIDE = 160  # longest side of each panel's image in a figure, in pixels
DPI = 64  # the figures' resolution: a panel (2.4 inches) is 154 pixels wide
FLUSH_SECONDS = 10  # how often what was written reaches the event files
MACHINE = ("load_s", "peak_gib")  # a training line's fields about the machine (`train.log`)
PLACE = ("event", "step", "epoch", "time")  # a record's fields that say where the run is, not how it does
# A validation's learning rate is the training lines' own (after the schedule's step); best.pt's step is no score.
NOT_SCORES = (*PLACE, "lr", "best_step")


def summary_writer():
    """`torch.utils.tensorboard.SummaryWriter`.

    Raises:
        CaptionerError: tensorboard is not installed; the message names the extra that brings it.
    """
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise CaptionerError(
            "--tensorboard needs the tensorboard package, which is not installed: pip install 'captioner[train]'"
        ) from None
    return SummaryWriter


def open_board(log_dir: str | None, *, main: bool, saved: dict | None) -> TensorBoard | None:
    """The run's board in `log_dir` (rank 0's: `main`), None without one; `saved`: a resumed run's last.pt.

    Raises:
        CaptionerError: tensorboard is not installed, on every rank alike, before the run starts.
    """
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
