"""`captioner`: caption images (`caption`), serve the web demo (`demo`), share a model (`export`), check a
device (`selfcheck`). `captioner caption --runtime onnx` imports no torch: PyTorch's modules are imported
where the other paths use them."""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Annotated, Literal

from tqdm import tqdm

from captioner.cli.run import ArgumentParser, run
from captioner.cli.selfcheck import SelfCheckOptions, selfcheck
from captioner.compiled import earns_back
from captioner.decoding.settings import Decoding
from captioner.demo.options import DemoOptions
from captioner.errors import CaptionerError, OptionError
from captioner.io import write_json_atomic
from captioner.options import Device, add_options, check_positive, from_args
from captioner.serve import bulk
from captioner.serve.onnx_runtime import OnnxCaptioner, on_onnx
from captioner.serve.sources import model_source


@dataclass(frozen=True)
class CaptionOptions:
    """`captioner caption`'s options (the images are its positional arguments)."""

    checkpoint: Annotated[
        str | None,
        "the model: a checkpoint written by `train.py fit`, an exported folder, URL#sha256=HEX or hf://ORG/NAME "
        "(default: the bundled demo model, which knows synthetic coloured shapes only)",
    ] = None
    recursive: Annotated[bool, "also take images in subdirectories of a directory"] = False
    decoding: Decoding = field(default_factory=Decoding)
    json: Annotated[
        str | None,
        "write the results at the end as COCO results JSON [{image_id, caption, "
        "file_name, ...}]; they are also appended as they are made to the --jsonl log, by default "
        "this name with extension .jsonl",
    ] = None
    jsonl: Annotated[str | None, "append one JSON line per captioned image as it is made (a killed run keeps them)"] = (
        None
    )
    resume: Annotated[bool, "skip the images already in the --jsonl log and append the rest"] = False
    attention: Annotated[
        bool, "put each caption's words and per-word attention maps (grid x grid, rows top to bottom) in the JSON"
    ] = False
    figures: Annotated[str | None, "write one attention figure (PNG) per image into this directory"] = None
    batch_size: Annotated[int, "images per batch through the model"] = 8
    workers: Annotated[int, "threads decoding images while the model runs (0: none)"] = 2
    device: Device = "auto"
    runtime: Annotated[
        Literal["auto", "torch", "onnx"],
        "torch: PyTorch; onnx: onnxruntime, on a folder `captioner export --onnx` wrote (no torch needed); "
        "auto: onnx for such a folder, else torch",
    ] = "auto"
    graphs: Annotated[
        bool, "on a GPU, compile the search and replay it as CUDA graphs for thousands of images (--no-graphs: never)"
    ] = True
    progress: Annotated[bool | None, "progress bar on stderr (default: when stderr is a terminal)"] = None

    def __post_init__(self):
        check_positive(self, "batch_size")
        if self.workers < 0:
            raise OptionError(f"--workers must be 0 or more, got {self.workers}")
        if self.resume and not self.log_path:
            raise OptionError("--resume needs the log to resume from: give --jsonl LOG (or --json OUT)")

    @property
    def log_path(self) -> str | None:
        if self.jsonl:
            return self.jsonl
        if self.json:
            return (self.json[:-5] if self.json.endswith(".json") else self.json) + ".jsonl"
        return None


def get_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="captioner", description="Caption images with a trained model, or serve the web demo.")
    sub = p.add_subparsers(dest="command", required=True)
    cp = sub.add_parser(
        "caption",
        help="caption images, optionally drawing attention figures",
        description="Caption image files, directories and glob patterns, in batches. "
        "Prints one 'path<TAB>caption' line per image; --json writes COCO results.",
    )
    cp.add_argument(
        "images",
        nargs="+",
        metavar="IMAGE",
        help="image files, directories of images, or glob patterns such as 'photos/*.jpg' "
        "(quoted, so that the shell leaves them alone; '**' matches subdirectories)",
    )
    add_options(cp, CaptionOptions)
    add_options(
        sub.add_parser("demo", help="serve the web demo (upload an image, see its caption and heatmaps)"), DemoOptions
    )
    ep = sub.add_parser(
        "export",
        help="write a trained model as a folder to share: model.safetensors, "
        "config.json, vocab.json and a README.md model card",
    )
    ep.add_argument(
        "checkpoint", nargs="?", metavar="CHECKPOINT", help="a checkpoint written by `train.py fit` (or a pinned URL)"
    )
    ep.add_argument(
        "out", nargs="?", metavar="DIR", help="the folder to write (publish it with `hf upload ORG/NAME DIR .`)"
    )
    ep.add_argument(
        "--onnx",
        metavar="DIR",
        help="write the model as ONNX graphs into DIR instead, for onnxruntime without PyTorch (`captioner caption "
        "--runtime onnx --checkpoint DIR`); the bundled model unless --checkpoint names another",
    )
    ep.add_argument("--checkpoint", dest="model", metavar="MODEL", help="with --onnx: the model to export")
    add_options(
        sub.add_parser(
            "selfcheck",
            help="train every mode briefly on a device (a GPU: --device cuda) and say which run, and how fast",
        ),
        SelfCheckOptions,
    )
    return p


def _caption(args: argparse.Namespace) -> int:
    opts = from_args(CaptionOptions, args)
    paths = bulk.expand_inputs(args.images, recursive=opts.recursive)
    if opts.checkpoint is None:
        print(
            "using the bundled demo model (synthetic coloured shapes only); --checkpoint chooses another",
            file=sys.stderr,
        )
    cap = _load(model_source(opts.checkpoint), opts)
    log = bulk.ResultLog(opts.log_path, resume=opts.resume) if opts.log_path else None
    done = log.done if log else {}
    ids = bulk.image_ids(list(dict.fromkeys([*done, *paths])))  # one id type over old and new
    todo = [p for p in paths if p not in done]
    if not isinstance(cap, OnnxCaptioner) and earns_back(-(-len(todo) // opts.batch_size)):
        cap.compile_search()
    if done:
        print(
            f"{opts.log_path}: {len(paths) - len(todo)} of {len(paths)} images already captioned, skipped",
            file=sys.stderr,
        )
    bar = tqdm(
        total=len(todo),
        unit="img",
        desc="captioning",
        file=sys.stderr,
        dynamic_ncols=True,
        disable=not (sys.stderr.isatty() if opts.progress is None else opts.progress),
    )

    def on_error(path, error):
        bar.update()
        tqdm.write(f"error: {error}", file=sys.stderr)

    try:
        outcome = bulk.caption_files(
            cap,
            todo,
            ids,
            batch_size=opts.batch_size,
            workers=opts.workers,
            attention=opts.attention,
            log=log,
            on_result=_shown(cap, opts, bar),
            on_error=on_error,
            decoding=opts.decoding,
        )
    finally:
        bar.close()
        if log:
            log.close()
    if opts.json:
        # Every image of this run's inputs that has a result, this run's or the log's, in input order.
        results = {**done, **{r["file_name"]: r for r in outcome.records}}
        write_json_atomic(opts.json, [{**results[p], "image_id": ids[p]} for p in paths if p in results])
    if outcome.failed:
        raise CaptionerError(f"{len(outcome.failed)} of {len(paths)} images could not be read")
    return 0


def _load(source: str, opts: CaptionOptions):
    """The model on the runtime `--runtime` names; an `OnnxCaptioner` needs no torch."""
    remote = "://" in source  # a URL or hf://, which `Captioner.load` fetches, then checks
    if not remote and on_onnx(source, opts.runtime):
        return OnnxCaptioner.load(source)
    from captioner.options import choose_device
    from captioner.serve.api import Captioner

    device, runtime = str(choose_device(opts.device)), opts.runtime if remote else "torch"
    return Captioner.load(source, device=device, graphs=opts.graphs, runtime=runtime)


def _shown(cap, opts: CaptionOptions, bar):
    """What happens to each captioned image: its line on stdout, notes on stderr, its figure."""
    if opts.figures:
        try:  # the figures' smoothing is PyTorch's
            from captioner.serve.heatmaps import attention_figure, figure_png
        except ImportError as e:
            raise CaptionerError(f"--figures draws with PyTorch, which cannot be imported here ({e})") from None
        os.makedirs(opts.figures, exist_ok=True)
    if cap.attention_warning and (opts.figures or opts.attention):
        tqdm.write(f"warning: {cap.attention_warning}", file=sys.stderr)

    def on_result(path, image, out, record):
        bar.update()
        tqdm.write(f"{path}\t{out.text}", file=sys.stdout)
        familiarity = record.get("familiarity")
        if familiarity and familiarity.get("unfamiliar"):
            tqdm.write(f"note: {path}: {familiarity.get('message', 'unlike the training images')}", file=sys.stderr)
        if opts.figures:
            fig = attention_figure(
                image,
                out.words,
                out.attention,
                preprocess=cap.preprocess,
                locations=out.locations,
                title=out.text,
                warning=cap.attention_warning,
            )
            # Named after the file; after its path where file names repeat (the ids are paths then).
            name = os.path.splitext(os.path.basename(path))[0]
            if record["image_id"] == path:
                name = re.sub(r"[^\w.-]+", "_", path)
            with open(os.path.join(opts.figures, f"{name}.png"), "wb") as f:
                f.write(figure_png(fig))

    return on_result


def _demo(args: argparse.Namespace) -> int:
    try:
        from captioner.demo.app import main
    except ImportError as e:
        if e.name != "gradio":
            raise
        raise CaptionerError("the web demo needs gradio: pip install 'captioner[demo]'") from None
    main(from_args(DemoOptions, args))
    return 0


def _export(args: argparse.Namespace) -> int:
    if args.onnx:
        from captioner.serve.onnx_export import export_onnx
        from captioner.serve.onnx_runtime import FILES

        if args.out or (args.checkpoint and args.model):
            raise OptionError("captioner export --onnx DIR [--checkpoint MODEL]: the model once, the folder once")
        print(f"wrote {export_onnx(model_source(args.model or args.checkpoint), args.onnx)}: {', '.join(FILES)}")
        return 0
    if not (args.checkpoint and args.out):
        raise OptionError("captioner export CHECKPOINT DIR (or captioner export --onnx DIR [--checkpoint MODEL])")
    from captioner.serve.export import export

    print(f"wrote {export(args.checkpoint, args.out)}: model.safetensors, config.json, vocab.json, README.md")
    return 0


def _selfcheck(args: argparse.Namespace) -> int:
    return 0 if selfcheck(from_args(SelfCheckOptions, args)) else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point of `captioner` (and `python -m captioner`)."""
    args = get_parser().parse_args(argv)
    handlers = {"caption": _caption, "demo": _demo, "export": _export, "selfcheck": _selfcheck}
    return run(handlers[args.command], args)
