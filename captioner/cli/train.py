"""`python train.py` / `captioner-train`: prepare, fit, evaluate, and the COCO recipe.

SIGTERM and Ctrl-C make `fit` and `prepare` finish their step or batch, save, and exit with 0
(SIGTERM, a clean preemption) or 130 (Ctrl-C); `fit --resume` and a second `prepare` go on.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from dataclasses import dataclass, field, fields
from typing import Annotated, Literal

from captioner.cli import coco
from captioner.cli.run import ArgumentParser, renamed, run
from captioner.decoding.settings import Decoding
from captioner.evaluation.evaluate import evaluate, results_path
from captioner.models.checkpoint import load_checkpoint
from captioner.models.decoder import DecoderConfig
from captioner.options import Device, add_options, choose_device, from_args
from captioner.train import distributed
from captioner.train.config import TrainConfig
from captioner.train.log import GracefulStop
from captioner.train.prepare import PrepareConfig, prepare
from captioner.train.resume import DERIVED
from captioner.train.trainer import FitJob, fit


@dataclass(frozen=True)
class FitOptions:
    """Where `fit` reads and writes; the rest of its options are `DecoderConfig` and `TrainConfig`."""

    data: Annotated[str, "a data directory written by prepare"]
    out: Annotated[str, "the run directory: writes last.pt, best.pt, metrics.jsonl"]
    init: Annotated[
        str | None,
        "start from this checkpoint's weights and decoder sizes, with a fresh optimizer "
        "(e.g. RUN/best.pt of a cross-entropy run)",
    ] = None
    boxes: Annotated[
        str | None,
        "object boxes in COCO instances format (optionally a 'color' per annotation) for the training images: "
        "caption words that name a boxed object also teach attention where it is (attention correctness); "
        "a resumed run is given them again",
    ] = None
    resume: Annotated[bool, "continue from RUN_DIR/last.pt"] = False
    device: Device = "auto"


@dataclass(frozen=True)
class EvaluateOptions:
    """`evaluate`'s options, named as `evaluation.evaluate.evaluate` takes them."""

    checkpoint: Annotated[
        str,
        "the model: a checkpoint written by fit (best.pt, last.pt), an exported folder, "
        "URL#sha256=HEX or hf://ORG/NAME",
    ]
    data_dir: Annotated[str, "--data", "a data directory written by prepare"]
    out: Annotated[str, "the metrics JSON; the captions go beside it in *_results.json"]
    split: Annotated[Literal["test", "val"], "which split to caption and score"] = "test"
    decoding: Decoding = field(default_factory=Decoding)
    grounding: Annotated[
        str | None,
        "COCO instances file of object boxes (instances_val2014.json or a scene "
        "set's boxes.json): also report attention pointing accuracy",
    ] = None
    device: Device = "auto"
    cuda_graphs: Annotated[
        Literal["auto", "off"],
        "on a GPU, compile the search and replay it as CUDA graphs where the split earns back the compile "
        "(off: never; see docs/training.md)",
    ] = "auto"


# Flags that were renamed: the old spelling still works, with a note.
RENAMED = {"--no-rotated": ["--no-views"], "--no-fused": ["--shapes", "fixed"]}


def get_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="train.py", description="Prepare data, train and evaluate Show, Attend and Tell.")
    sub = p.add_subparsers(dest="command", required=True)
    add_options(
        sub.add_parser(
            "prepare", help="vocabulary and feature cache from COCO captions (or a Karpathy dataset file) and images"
        ),
        PrepareConfig,
    )
    fp = sub.add_parser("fit", help="train the decoder on a prepared data directory")
    add_options(fp, FitOptions)
    add_options(fp, DecoderConfig, group="model", derived=DERIVED)
    add_options(fp, TrainConfig, group="training", derived=DERIVED)
    add_options(sub.add_parser("evaluate", help="caption a split and score it with coco-caption"), EvaluateOptions)
    coco.add_parser(sub)
    return p


def _prepare(args: argparse.Namespace) -> int:
    cfg = from_args(PrepareConfig, args)
    d, _ = distributed.setup(cfg.device)
    with GracefulStop(announce=d.main) as stop:
        summary = prepare(cfg, dist=d, progress=d.main, stop=stop)
    distributed.cleanup()
    if "stopped" in summary:
        if d.main:
            print(
                f"stopped by {summary['stopped']}: {summary['features_done']} feature rows are on disk, "
                f"{summary['features_to_do']} to do; run the same prepare again to go on",
                file=sys.stderr,
            )
        return stop.exit_status
    if d.main:
        print(json.dumps(summary, indent=1))
    return 0


def _fit(args: argparse.Namespace) -> int:
    where = from_args(FitOptions, args)
    model = from_args(DecoderConfig, args, vocab_size=0)
    cfg = from_args(TrainConfig, args)
    main = int(os.environ.get("RANK", "0")) == 0
    with GracefulStop(announce=main) as stop:
        command = shlex.join(["python", "train.py", *args.typed])
        job = FitJob(
            where.data, where.out, model, cfg, where.init, where.boxes, where.resume, where.device, command=command
        )
        p = fit(job, stop)
    distributed.cleanup()
    if stop.requested:
        if main:
            print(
                f"stopped by {stop.signal_name} at step {p.step}: {os.path.join(where.out, 'last.pt')} saved; "
                "`fit --resume` continues from it",
                file=sys.stderr,
            )
        return stop.exit_status
    if main:
        print(
            f"done: {p.step} steps, {p.epoch} epochs; best {_metric(where.out, cfg)} {p.best:.4f} at step "
            f"{p.best_step}; checkpoints in {where.out}"
        )
    return 0


def _metric(run: str, cfg: TrainConfig) -> str:
    """The metric that chose the run's best.pt: a resumed run's own, not this command's."""
    best = os.path.join(run, "best.pt")
    if not os.path.isfile(best):
        return cfg.schedule.metric
    return load_checkpoint(best)["train"]["schedule"]["metric"]


def _evaluate(args: argparse.Namespace) -> int:
    opts = from_args(EvaluateOptions, args)
    given = {f.name: getattr(opts, f.name) for f in fields(opts)}
    m = evaluate(**{**given, "device": str(choose_device(opts.device))})
    shown = {
        k: (round(v, 4) if isinstance(v, float) else v) for k, v in m.items() if k not in ("checkpoint", "grounding")
    }
    print(json.dumps(shown, indent=1))
    print(f"metrics: {opts.out}\ncaptions: {results_path(opts.out)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python train.py` and `captioner-train`."""
    typed = sys.argv[1:] if argv is None else argv
    args = get_parser().parse_args(renamed(typed, RENAMED))
    args.typed = typed  # fit records the command line as typed
    handlers = {"prepare": _prepare, "fit": _fit, "evaluate": _evaluate, "coco": coco.run}
    return run(handlers[args.command], args)


if __name__ == "__main__":
    sys.exit(main())
