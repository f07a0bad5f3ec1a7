"""What a cluster job meets and survives: preemption and Ctrl-C, a full disk, damaged features.

Shapes: n rows of (L, D) features, L locations, D feature size.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence

import torch

from captioner.data.features import damaged_row_message

# Exit status after a graceful stop: 0 for SIGTERM (the job did what a preemption notice asks:
# saved and stopped, so it is not reported as a failure), 130 for Ctrl-C (the shell's convention,
# so that `fit && evaluate` does not go on).
EXIT_STATUS = {signal.SIGTERM: 0, signal.SIGINT: 130}

log = logging.getLogger(__name__)


def first_nonfinite(state: dict) -> str | None:
    """The name of the first floating-point tensor in a state dict holding an inf or NaN, else None."""
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
        """0 after SIGTERM (a clean preemption), 130 after SIGINT."""
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
            log.warning(message)
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
