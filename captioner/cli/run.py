"""What every command line shares: logging set up for a program, and a user's mistake as one `error:` line."""

from __future__ import annotations

import argparse
import errno
import logging
import sys
from collections.abc import Callable

from tqdm import tqdm

from captioner.errors import CaptionerError

# The training CLI, run by this Python (`python -m captioner.cli.train` is `train.py`): for subprocesses.
TRAIN_MODULE = "captioner.cli.train"
TRAIN = [sys.executable, "-m", TRAIN_MODULE]


class ArgumentParser(argparse.ArgumentParser):
    """argparse that keeps a description's line breaks (the options' own help says their defaults)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)


class _Lines(logging.Handler):
    """The library's messages on stderr, one line each, through tqdm so that a progress bar stays whole."""

    def emit(self, record: logging.LogRecord) -> None:
        prefix = f"{record.levelname.lower()}: " if record.levelno >= logging.WARNING else ""
        tqdm.write(prefix + record.getMessage(), file=sys.stderr)


def renamed(argv: list[str], names: dict[str, list[str]]) -> list[str]:
    """The arguments with each renamed flag (a key of `names`) spelt as it is now, saying so on stderr."""
    out = []
    for arg in argv:
        if arg in names:
            print(f"note: {arg} is now {' '.join(names[arg])}", file=sys.stderr)
            out += names[arg]
        else:
            out.append(arg)
    return out


def setup_logging() -> None:
    """Show the package's warnings and notes (INFO and up) on stderr; idempotent."""
    logger = logging.getLogger("captioner")
    if not any(isinstance(h, _Lines) for h in logger.handlers):
        logger.addHandler(_Lines())
    logger.setLevel(logging.INFO)


def run(handler: Callable[[argparse.Namespace], int | None], args: argparse.Namespace) -> int:
    """Call a command's handler, turning user errors into one line and an exit status."""
    setup_logging()
    try:
        return handler(args) or 0
    except CaptionerError as e:  # OptionError included: the one way a command refuses bad input
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        # A full disk or quota wherever a write was not given its own message.
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        print(f"error: {e.strerror}{f' ({e.filename})' if e.filename else ''}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            "interrupted; finished work is kept (prepare resumes, fit --resume continues, "
            "caption --resume skips the images already captioned)",
            file=sys.stderr,
        )
        return 130
