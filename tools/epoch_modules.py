"""Which of the package's modules one epoch of `fit` enters: those whose functions run, imports aside.

    python -m tools.epoch_modules DATA_DIR RUN_DIR

trains one epoch of a small decoder on a prepared data directory (the start, the steps, the validation, the
saves and the end) with a profiler on, and lists each module of `captioner/` whose code ran, with the count.
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

from captioner.models.decoder import DecoderConfig
from captioner.train.config import TrainConfig
from captioner.train.trainer import FitJob, Trainer

PACKAGE = Path(__file__).resolve().parents[1] / "captioner"


def entered_modules(job: FitJob) -> list[str]:
    """The package's modules (paths under captioner/) whose functions ran while `job` trained."""
    entered: set[str] = set()

    def profile(frame, event, arg):
        path = Path(frame.f_code.co_filename)
        if event == "call" and frame.f_code.co_name != "<module>" and PACKAGE in path.parents:
            entered.add(str(path.relative_to(PACKAGE.parent)))

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        Trainer(job).fit()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return sorted(entered)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data")
    p.add_argument("out")
    args = p.parse_args(argv)
    small = DecoderConfig(0, embed_dim=32, hidden_dim=48, attention_dim=24)
    cfg = TrainConfig.of(epochs=1, batch_size=16, val_beam_size=1)
    modules = entered_modules(FitJob(args.data, args.out, small, cfg, device="cpu", progress_bar=False))
    print("\n".join(modules))
    print(f"{len(modules)} modules")


if __name__ == "__main__":
    main()
