"""`train.py coco ROOT`: from nothing to a COCO model in one command, resumable at every stage.

The stages run in order: fetch (download, check and unpack COCO 2014 and Karpathy's split),
prepare, fit, evaluate (the Karpathy test split) and export (ROOT/model, ready for `hf upload`).
Each one records in ROOT/recipe.json that it finished and what it produced; a rerun skips the
finished stages whose products are still there and resumes a partial one: a download goes on
from its .part file, `prepare` keeps its finished feature rows, `fit` continues from last.pt.
Later stages run as subprocesses of the training CLI, each command printed before it runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from captioner.cli.coco_stages import RUNS, CocoOptions, Paths, paths_of
from captioner.cli.run import ArgumentParser
from captioner.cli.run import run as run_command
from captioner.io import read_json, write_json_atomic
from captioner.options import add_options, from_args

STAGES = ("fetch", "prepare", "fit", "evaluate", "export")
RESULTS = ("evaluate", "export")
NEEDS = {"fetch": (), "prepare": ("fetch",), "fit": ("prepare",), "evaluate": ("prepare", "fit"), "export": ("fit",)}


def to_run(stages: dict, only: str | None) -> list[str]:
    """The stages to run: those never finished or finished before the fit they score or export, and
    those whose products are gone and are the recipe's results or read by a stage that runs (so
    the images can be deleted once prepared)."""
    fit = stages.get("fit", {}).get("finished", "")
    fresh = {s: s in stages and (s not in RESULTS or stages[s]["finished"] >= fit) for s in STAGES}
    kept = {s: fresh[s] and all(map(os.path.exists, paths_of(stages[s]["outputs"]))) for s in STAGES}
    if only:
        return [] if kept[only] else [only]
    todo: list[str] = []
    for s in reversed(STAGES):
        readers = [t for t in STAGES if s in NEEDS[t]]
        if not fresh[s] or (not kept[s] and (not readers or any(t in todo for t in readers))):
            todo.insert(0, s)
    # A new fit makes new scores and a new export; fetch and prepare remake the same files.
    return todo + [s for s in RESULTS if "fit" in todo and s not in todo]


def run(args: argparse.Namespace) -> int:
    """Run the recipe's stages that have not finished (or `--stage`'s), recording each in ROOT/recipe.json."""
    opts, paths = from_args(CocoOptions, args), Paths(os.path.abspath(args.root))
    os.makedirs(paths.root, exist_ok=True)
    record = read_json(paths.record, "recipe record") if os.path.exists(paths.record) else {}
    stages = record.setdefault("stages", {})
    todo = to_run(stages, opts.stage)
    for stage in [opts.stage] if opts.stage else STAGES:
        if stage not in todo:
            print(f"{stage}: finished at {stages[stage]['finished']}; nothing to do")
            continue
        print(f"== {stage}", flush=True)
        start = time.monotonic()
        outcome = RUNS[stage](opts, paths)
        if isinstance(outcome, int):
            return outcome
        stages[stage] = {
            "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "seconds": round(time.monotonic() - start, 1),
            **outcome,
        }
        write_json_atomic(paths.record, record)
    if not todo:
        print(f"nothing to do: {opts.stage or 'every stage'} had finished ({paths.record})")
    elif "export" in todo:
        print(
            f"done: {paths.model} captions images (captioner caption --checkpoint {paths.model} IMAGE); "
            f"share it with: hf upload ORG/NAME {paths.model} ."
        )
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "coco",
        help="from nothing to a COCO model: fetch, prepare, fit, evaluate, export (each resumable)",
        description=__doc__.split("\n\n")[1],
    )
    p.add_argument("root", metavar="ROOT", help="the folder that holds everything: data, run, model, recipe.json")
    add_options(p, CocoOptions)
    return p


def main(argv: list[str] | None = None) -> int:
    """`python -m captioner.cli.coco ROOT ...`: the same as `train.py coco ROOT ...`."""
    parser = ArgumentParser(prog="train.py")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return run_command(run, parser.parse_args(["coco", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    sys.exit(main())
