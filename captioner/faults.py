"""What a cluster job meets and survives: a full disk, preemption, damaged features.

- `GracefulStop`: SIGTERM (a scheduler's preemption notice) and SIGINT (Ctrl-C) set a flag
  instead of killing the process; `fit` and `prepare` look at it at safe points, save, and end.
- `CheckpointSaver`: a checkpoint save that fails (no space left, quota, read-only) is reported
  in one line naming the last good checkpoint and its step, instead of ending with a traceback;
  the caller decides whether to retry at the next save or to stop.
- `nonfinite_rows`: a cheap check of fp16 feature rows for inf/NaN (a bad sector, a broken
  encoder run), so that they are named and left out before they reach the model.

Shapes: n rows of (L, D) features, L locations, D feature size.
"""
from __future__ import annotations

import errno
import os
import shutil
import signal
import sys
import threading
from collections.abc import Callable, Sequence

import numpy as np
import torch

from .checkpoint import save_checkpoint
from .errors import CaptionerError

# Exit status after a graceful stop: 0 for SIGTERM (the job did what a preemption notice asks:
# saved and stopped, so it is not reported as a failure), 130 for Ctrl-C (the shell's convention,
# so that `fit && evaluate` does not go on).
EXIT_STATUS = {signal.SIGTERM: 0, signal.SIGINT: 130}


# helpers

def _size(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} bytes"
    for unit in ("KB", "MB"):
        n /= 1024
        if n < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} GB"


def describe_os_error(err: OSError, path: str) -> str:
    """What a failed write means, in words that name the place: 'no space left on ... (3 MB free)'.

    Args:
        path: the file written, or its directory.
    """
    where = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path)) or "."
    if err.errno == errno.ENOSPC:
        try:
            free = f" ({_size(shutil.disk_usage(where).free)} free)"
        except OSError:
            free = ""
        return f"no space left on the device holding {where}{free}"
    if err.errno == errno.EDQUOT:
        return f"disk quota exceeded on {where}"
    if err.errno == errno.EROFS:
        return f"{where} is on a read-only file system"
    if err.errno in (errno.EACCES, errno.EPERM):
        return f"permission denied writing in {where}"
    return f"{err.strerror or err} (writing in {where})"


def disk_error(err: OSError, path: str, what: str) -> CaptionerError:
    """A CaptionerError for a failed write of `what` to `path`, in one line."""
    return CaptionerError(f"cannot write {what} {path}: {describe_os_error(err, path)}")


def check_free_space(path: str, needed: int, what: str) -> str | None:
    """Why a long write of `needed` more bytes to `path` will not fit, or None if it fits.

    A warning, not a refusal: free space moves while a job runs, and some file systems count
    allocation loosely; the write itself is what fails for certain.
    """
    where = os.path.dirname(os.path.abspath(path)) or "."
    free = shutil.disk_usage(where).free
    if needed <= free:
        return None
    return f"{what} {path} needs {_size(needed)} more, but the device holding {where} has {_size(free)} free"


def all_finite(values: dict) -> bool:
    """True if every number in a dict of loss terms is finite."""
    return all(np.isfinite(v) for v in values.values())


def nonfinite_rows(features: np.ndarray) -> np.ndarray:
    """Which of n feature rows hold an inf or NaN anywhere; (n, ...) → (n,) bool.

    On fp16 a bit test: inf and NaN are exactly the values whose five exponent bits are all set,
    so the largest magnitude bit pattern of a row finds one in one integer pass (2.5 ms for a
    32 × 196 × 512 batch on one core, against 16 ms for np.isfinite).
    """
    n = len(features)
    if n == 0 or features.size == 0:
        return np.zeros(n, dtype=bool)
    flat = np.ascontiguousarray(features).reshape(n, -1)       # (n, L*D)
    if flat.dtype == np.float16:
        return (flat.view(np.uint16) & 0x7FFF).max(axis=1) >= 0x7C00
    return ~np.isfinite(flat).all(axis=1)


def damaged_row_message(image_id, path: str, row: int, cache_path: str, consequence: str) -> str:
    """One line naming a damaged feature row's image and how to re-extract it."""
    return (f"image {image_id} ({path}): its features (row {row} of {cache_path}) hold inf or NaN, so "
            f"{consequence}; re-extract them with `train.py prepare ... --recheck` (the same flags as before)")


def first_nonfinite(state: dict) -> str | None:
    """The name of the first floating-point tensor in a state dict holding an inf or NaN, else None."""
    for name, value in state.items():
        if torch.is_tensor(value) and value.is_floating_point() and not bool(torch.isfinite(value).all()):
            return name
    return None


# classes

class GracefulStop:
    """Context manager: SIGTERM and SIGINT ask for a stop at the next safe point instead of killing.

    Inside the block the first signal only sets `requested`; the code under it finishes its
    current unit of work (a training step, a batch of features), saves, and returns. Repeats of
    the signal are ignored while it does (under torchrun a Ctrl-C reaches each worker twice: from
    the terminal and from the agent); SIGKILL or Ctrl-\\ (SIGQUIT) still end it at once. Outside
    the main thread signals cannot be caught, and the block does nothing.

    Args:
        announce: write one line to stderr when a signal arrives (rank 0 only under torchrun).
    """

    def __init__(self, signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT), *, announce: bool = True):
        self.signals, self.announce = tuple(signals), announce
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "GracefulStop":
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
            os.write(sys.stderr.fileno(), f"\n{signal.Signals(signum).name}: stopping after the current "
                                          "step, then saving (SIGKILL ends it at once)\n".encode())

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
        """0 after SIGTERM (a clean preemption), 130 after SIGINT."""
        return EXIT_STATUS.get(self.signum, 0)


def stop_requested(stop: GracefulStop | None) -> bool:
    return stop is not None and stop.requested


class CheckpointSaver:
    """Saves checkpoints and reports a failed save instead of raising.

    `save_checkpoint` writes a temporary file and renames it, so a failed save leaves the
    previous file whole and no temporary file behind; the saver adds the account: one line
    naming the failure and the last good checkpoint with its step, and a record of which files'
    latest save failed, so that training can go on (retrying at the next save) and stop with
    that message if its final save fails.

    Args:
        good: path → step of checkpoints already known to be whole (e.g. the resumed last.pt).
    """

    def __init__(self, good: dict[str, int] | None = None):
        self.good: dict[str, int] = dict(good or {})
        self.failed: dict[str, str] = {}      # path → message of its latest failed save

    def last_good(self, path: str) -> str:
        if path in self.good:
            return f"the last good checkpoint is {path} at step {self.good[path]}"
        return f"{path} has not been saved by this run yet"

    def save(self, ck: dict, path: str) -> bool:
        """Save `ck` (with a "step" and a "model" state dict) to `path`; False if the write failed.

        Raises:
            CaptionerError: the model's weights are not finite; such a checkpoint is never
                written over a good one.
        """
        bad = first_nonfinite(ck["model"])
        if bad is not None:
            raise CaptionerError(f"the model's weights are not finite at step {ck['step']} ({bad}); not "
                                 f"saving {path}; {self.last_good(path)}")
        try:
            save_checkpoint(ck, path)
        except OSError as e:
            message = (f"cannot save {path} at step {ck['step']}: {describe_os_error(e, path)}; "
                       f"{self.last_good(path)}")
            self.failed[path] = message
            return False
        self.good[path] = int(ck["step"])
        self.failed.pop(path, None)
        return True


class FaultLog:
    """One-line warnings about the faults training goes on through, on stderr and in metrics.jsonl.

    Args:
        write_log: appends a record to the run's metrics.jsonl.
        show: print warnings about shared state (rank 0 only under torchrun).
        print_line: how a line reaches the user (e.g. tqdm.write, to keep a progress bar intact).
    """

    def __init__(self, write_log: Callable[[dict], None], show: bool = True,
                 print_line: Callable[[str], None] | None = None):
        self.write_log, self.show = write_log, show
        self.print_line = print_line or (lambda line: print(line, file=sys.stderr, flush=True))
        self.named: set[int] = set()          # feature rows already reported

    def warn(self, event: str, message: str, *, show: bool = True, local: bool = False, **fields) -> None:
        """Print "warning: <message>" and log {"event": event, **fields, "message": message}.

        Args:
            show: print it (else only log it).
            local: a fault this process alone met (its share of a batch), printed on every rank.
        """
        if show and (self.show or local):
            self.print_line(f"warning: {message}")
        self.write_log({"event": event, **fields, "message": message})

    def skipped_step(self, step: int, terms: dict, scaled: bool = False) -> None:
        """Report a step that was not applied because a loss term or the gradient was not finite.

        Args:
            scaled: fp16 training with a gradient scaler, which finds its scale by overflowing now
                and then: such a step (finite loss, infinite gradient) is logged but not printed.
        """
        shown = ", ".join(f"{k} {v:.4g}" for k, v in terms.items())
        overflow = scaled and np.isfinite(terms["loss"])
        self.warn("skipped_step", f"step {step}: not finite ({shown}); the step was skipped, the weights "
                  "are unchanged", show=not overflow, step=step, **{k: str(v) for k, v in terms.items()})

    def damaged_rows(self, rows: Sequence[int], data, step: int) -> None:
        """Report feature rows whose captions were left out of a batch; each image once per run.

        Args:
            rows: one entry per caption left out (an image's row repeats for each of its captions).
            data: the CaptionData the rows belong to.
        """
        for row in sorted(set(int(r) for r in rows) - self.named):
            self.named.add(row)
            image_id, path = data.meta["image_ids"][row], data.path_of(row)
            self.warn("damaged_features", damaged_row_message(image_id, path, row, data.cache.path,
                                                              "its captions are left out of training"),
                      local=True, step=step, image_id=image_id, file=path, row=row)
