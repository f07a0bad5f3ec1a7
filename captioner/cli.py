"""Command lines: `train.py` / `captioner-train` (prepare, fit, evaluate) and `captioner caption`.

Mistakes in the user's input end with one `error:` line naming the file or flag, never a
traceback; exit status 2 for such errors and for a full disk. SIGTERM and Ctrl-C make `fit`
and `prepare` finish their step or batch, save, and exit with 0 (SIGTERM, a clean preemption)
or 130 (Ctrl-C); `fit --resume` and a second `prepare` go on from there.
"""
from __future__ import annotations

import argparse
import errno
import json
import os
import re
import sys
from collections.abc import Callable

from .errors import CaptionerError


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def _device(text: str) -> str:
    # Checked here so that a typo is a usage error, not torch's traceback at load time.
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {text!r}")
    return text


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def get_train_parser() -> argparse.ArgumentParser:
    from .decoder import DecoderConfig
    from .finetune import STARTS as FINE_TUNE_STARTS, FineTuneConfig
    from .reinforce import HardAttentionConfig
    from .scst import LR as SCST_LR, ScstConfig
    from .training import TrainConfig
    t, m, h, ft, sc = TrainConfig(), DecoderConfig(0), HardAttentionConfig(), FineTuneConfig(), ScstConfig()
    p = argparse.ArgumentParser(prog="train.py", description="Train and evaluate Show, Attend and Tell.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    pp = sub.add_parser("prepare", help="vocabulary + feature cache from COCO captions (or a Karpathy "
                        "dataset file) and images", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    pp.add_argument("--images", nargs="+", required=True, metavar="DIR",
                    help="image directories, searched in order (e.g. train2014 val2014)")
    source = pp.add_mutually_exclusive_group(required=True)
    source.add_argument("--captions", nargs="+", metavar="COCO_JSON",
                        help="COCO captions files (e.g. captions_train2014.json captions_val2014.json)")
    source.add_argument("--karpathy", metavar="KARPATHY_JSON",
                        help="instead of --captions/--splits: Karpathy's dataset_coco.json, "
                        "dataset_flickr8k.json or dataset_flickr30k.json (captions and split in one file; "
                        "images are DIR/filepath/filename or DIR/filename)")
    pp.add_argument("--splits", metavar="KARPATHY_JSON", help="Karpathy split file (dataset_coco.json); "
                    "default: a deterministic 90/5/5 split")
    pp.add_argument("--out", required=True, metavar="DATA_DIR", help="data directory to write")
    pp.add_argument("--encoder", choices=["vgg16", "vgg19"], default="vgg16", help="VGG variant")
    pp.add_argument("--encoder-weights", default="imagenet", metavar="imagenet|none|PATH",
                    help="ImageNet weights via torchvision, a random seeded encoder, or a state dict")
    pp.add_argument("--encoder-seed", type=int, default=0, help="seed of --encoder-weights none")
    pp.add_argument("--crop", action="store_true", help="resize-256/centre-crop-224 as in the paper "
                    "instead of resizing the whole image to 224x224")
    pp.add_argument("--min-word-freq", "--min-count", dest="min_word_freq", type=_positive_int, default=5,
                    help="words seen fewer times in the training split's captions become <unk> "
                    "(val and test captions are not counted)")
    pp.add_argument("--max-len", type=_positive_int, default=20, help="longer training captions are left out")
    pp.add_argument("--skip-missing", action="store_true", help="go on without images whose file is missing")
    pp.add_argument("--skip-bad", action="store_true",
                    help="go on without malformed annotations and unreadable images")
    pp.add_argument("--batch-size", type=_positive_int, default=None,
                    help="images per encoder batch (default: 8 on CPU, 64 on GPU)")
    pp.add_argument("--workers", type=int, default=2, help="DataLoader workers decoding images")
    pp.add_argument("--device", default="auto", help="auto, cpu or cuda")
    pp.add_argument("--recheck", action="store_true", help="read every finished feature row first and "
                    "extract again those holding inf or NaN (a damaged disk or copy)")
    pp.add_argument("--no-rotated", dest="rotated", action="store_false",
                    help="skip the features of the images turned 180° (they let soft attention learn to look "
                    "at the objects themselves, README 'Does attention look at the right thing?'; "
                    "without them the encoder runs half as long)")

    fp = sub.add_parser("fit", help="train the decoder on a prepared data directory",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    fp.add_argument("--data", required=True, metavar="DATA_DIR", help="a directory written by prepare")
    fp.add_argument("--out", required=True, metavar="RUN_DIR", help="writes last.pt, best.pt, metrics.jsonl")
    fp.add_argument("--attention", choices=["soft", "hard"], default=m.attention,
                    help="soft: deterministic attention; hard: sampled locations trained with REINFORCE")
    fp.add_argument("--epochs", type=_positive_int, default=t.epochs, help="passes over the training captions")
    fp.add_argument("--max-minutes", type=_positive_float, default=None,
                    help="stop at a step boundary after this long, then validate and save")
    fp.add_argument("--resume", action="store_true", help="continue from RUN_DIR/last.pt")
    fp.add_argument("--device", default="auto", help="auto, cpu or cuda")
    fp.add_argument("--batch-size", type=_positive_int, default=t.batch_size, help="captions per step")
    fp.add_argument("--lr", type=_positive_float, default=None,
                    help=f"Adam learning rate (default: {t.lr:g} for xe, {SCST_LR:g} for scst)")
    fp.add_argument("--grad-clip", type=_positive_float, default=t.grad_clip, help="clip the gradients' total norm to this")
    fp.add_argument("--alpha-c", type=float, default=t.alpha_c, help="doubly stochastic regularisation λ of eq. (14); the paper uses 1")
    fp.add_argument("--dropout", type=float, default=None,
                    help="dropout before the output layer (default: 0.2 soft, 0.5 hard; 0.5 is usual on COCO)")
    fp.add_argument("--embed-dim", type=_positive_int, default=m.embed_dim, help="word embedding size m")
    fp.add_argument("--hidden-dim", type=_positive_int, default=m.hidden_dim, help="LSTM state size n")
    fp.add_argument("--attention-dim", type=_positive_int, default=m.attention_dim,
                    help="hidden size of the attention MLP")
    fp.add_argument("--patience", type=_positive_int, default=t.patience,
                    help="validations without improvement before stopping early")
    fp.add_argument("--metric", choices=["CIDEr", "BLEU-4"], default=t.metric, help="for best.pt and early stopping")
    fp.add_argument("--val-beam-size", type=_positive_int, default=t.val_beam_size,
                    help="beam size of the validation captions (1: greedy)")
    fp.add_argument("--val-images", type=_positive_int, default=t.val_images, help="validation images per epoch")
    fp.add_argument("--checkpoint-every", type=int, default=t.checkpoint_every,
                    help="also write last.pt every N steps (0: off)")
    fp.add_argument("--checkpoint-minutes", type=float, default=t.checkpoint_minutes,
                    help="also write last.pt when this many minutes have passed since the last save "
                         "(0: off), so a killed run loses at most that much")
    fp.add_argument("--log-every", type=_positive_int, default=t.log_every, help="steps between log lines")
    fp.add_argument("--seed", type=int, default=t.seed, help="seed of the initial weights, batches and dropout")
    fp.add_argument("--amp", choices=["none", "bf16", "fp16"], default=t.amp,
                    help="mixed precision (autocast); fp16 adds a gradient scaler on CUDA")
    fp.add_argument("--compile", action="store_true", help="torch.compile the decoder's recurrent step (for GPUs; on a 2-core CPU it gained "
                    "nothing measurable, after ~30 s of compiling)")
    fp.add_argument("--equivariance", type=float, default=t.equivariance, metavar="LAMBDA",
                    help="weight of the half-turn equivariance of the attention maps (soft; hard: on its "
                    "expected-context captions); needs the rotated features prepare writes by default; "
                    "0: the paper's objective")
    fp.add_argument("--entropy-weight", type=float, default=h.entropy_weight, help="hard attention: λ_e")
    fp.add_argument("--reward-scale", type=float, default=h.reward_scale, help="hard attention: λ_r")
    fp.add_argument("--semi-sampling", type=float, default=h.semi_sampling,
                    help="hard attention: probability of the expected context instead of a sample")
    fp.add_argument("--baseline-decay", type=float, default=h.baseline_decay, help="hard attention")
    fp.add_argument("--fine-tune-encoder", action="store_true",
                    help="train the encoder's last layers with the decoder (the checkpoint then holds them "
                    "under encoder_state); conv5_1 first caches pool4 outputs in the data directory, once")
    fp.add_argument("--fine-tune-from", choices=list(FINE_TUNE_STARTS), default=None,
                    help=f"first trained layer (default {ft.start}): conv5_1 runs on cached pool4 outputs, "
                    "conv4_1 on the images")
    fp.add_argument("--encoder-lr", type=_positive_float, default=None,
                    help=f"Adam learning rate of the encoder's layers (default {ft.lr})")
    fp.add_argument("--workers", type=int, default=ft.workers,
                    help="DataLoader workers decoding images when fine-tuning (pool4 cache, conv4_1 batches)")
    # self-critical training (issue 11)
    fp.add_argument("--objective", choices=["xe", "scst"], default=t.objective,
                    help="xe: cross-entropy; scst: self-critical training on CIDEr-D, from --init or --resume "
                         "(a resumed run keeps its own objective)")
    fp.add_argument("--init", metavar="CKPT", default=None,
                    help="start from this checkpoint's weights and decoder sizes, with a fresh optimizer "
                         "(e.g. RUN/best.pt of a cross-entropy run)")
    fp.add_argument("--samples", type=_positive_int, default=sc.samples, help="scst: captions sampled per image")
    fp.add_argument("--scst-baseline", choices=["mean", "greedy"], default=sc.baseline,
                    help="scst: mean reward of the image's other samples (Luo 2020) or of the greedy caption (Rennie 2017)")
    fp.add_argument("--bleu-weight", type=float, default=sc.bleu_weight, help="scst: reward = CIDEr-D + this x BLEU-4")
    fp.add_argument("--scst-context", choices=["expected", "sample"], default=sc.context,
                    help="scst, hard attention: sample words with the expected context, or sample locations too")

    ep = sub.add_parser("evaluate", help="caption a split and score it with coco-caption",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ep.add_argument("--checkpoint", required=True, metavar="CKPT", help="a checkpoint written by fit (best.pt, last.pt)")
    ep.add_argument("--data", required=True, metavar="DATA_DIR", help="a directory written by prepare")
    ep.add_argument("--split", choices=["test", "val"], default="test", help="which split to caption and score")
    ep.add_argument("--out", required=True, metavar="METRICS_JSON",
                    help="metrics; the captions go beside it in *_results.json")
    ep.add_argument("--beam-size", type=_positive_int, default=3, help="beam width (1: greedy)")
    ep.add_argument("--max-len", type=_positive_int, default=None, help="default: the training maximum")
    ep.add_argument("--mode", choices=["expected", "argmax", "sample"], default=None,
                    help="context for hard-attention models (default expected)")
    ep.add_argument("--grounding", metavar="BOXES", help="COCO instances file (instances_val2014.json or "
                    "the synthetic boxes.json): also report attention pointing accuracy")
    ep.add_argument("--device", default="auto", help="auto, cpu or cuda")
    return p


def _prepare(args) -> int:
    from . import distributed
    from .encoder import EncoderSpec
    from .faults import GracefulStop
    from .prepare import prepare
    d, device = distributed.setup(args.device)
    spec = EncoderSpec(arch=args.encoder, weights=args.encoder_weights, seed=args.encoder_seed, crop=args.crop)
    with GracefulStop(announce=d.main) as stop:
        summary = prepare(args.captions, args.images, args.out, splits=args.splits, karpathy=args.karpathy,
                          encoder=spec, min_count=args.min_word_freq, max_len=args.max_len,
                          skip_missing=args.skip_missing, skip_bad=args.skip_bad, batch_size=args.batch_size,
                          workers=args.workers, device=str(device), dist=d, progress=d.main,
                          recheck=args.recheck, stop=stop, rotated=args.rotated)
    distributed.cleanup()
    if "stopped" in summary:
        if d.main:
            print(f"stopped by {summary['stopped']}: {summary['features_done']} feature rows are on disk, "
                  f"{summary['features_to_do']} to do; run the same prepare again to go on", file=sys.stderr)
        return stop.exit_status
    if d.main:
        print(json.dumps(summary, indent=1))
    return 0


def _fit(args) -> int:
    from .decoder import DecoderConfig
    from .faults import GracefulStop
    from .reinforce import HardAttentionConfig
    from .scst import ScstConfig
    from .training import TrainConfig, fit
    model = DecoderConfig(0, embed_dim=args.embed_dim, hidden_dim=args.hidden_dim,
                          attention_dim=args.attention_dim, dropout=args.dropout, attention=args.attention)
    hard = HardAttentionConfig(args.entropy_weight, args.reward_scale, args.semi_sampling, args.baseline_decay)
    if args.scst_baseline == "mean" and args.samples < 2:
        raise CaptionerError("--samples: the mean baseline needs at least 2 samples per image "
                             "(or pass --scst-baseline greedy)")
    scst = ScstConfig(samples=args.samples, baseline=args.scst_baseline, bleu_weight=args.bleu_weight,
                      context=args.scst_context)
    cfg = TrainConfig(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, grad_clip=args.grad_clip,
                      alpha_c=args.alpha_c, equivariance=args.equivariance, max_minutes=args.max_minutes,
                      patience=args.patience,
                      metric=args.metric, val_beam_size=args.val_beam_size, val_images=args.val_images,
                      checkpoint_every=args.checkpoint_every,
                      checkpoint_minutes=args.checkpoint_minutes, log_every=args.log_every, seed=args.seed, amp=args.amp,
                      compile=args.compile, hard=hard, objective=args.objective, init=args.init, scst=scst,
                      fine_tune=_fine_tune_config(args))
    from . import distributed
    main = int(os.environ.get("RANK", "0")) == 0
    with GracefulStop(announce=main) as stop:
        p = fit(args.data, args.out, model, cfg, resume=args.resume, device=args.device, stop=stop)
    distributed.cleanup()
    if stop.requested:
        if main:
            print(f"stopped by {stop.signal_name} at step {p.step}: {os.path.join(args.out, 'last.pt')} saved; "
                  "`fit --resume` continues from it", file=sys.stderr)
        return stop.exit_status
    if main:
        print(f"done: {p.step} steps, {p.epoch} epochs; best {cfg.metric} {p.best:.4f} at step {p.best_step}; "
              f"checkpoints in {args.out}")
    return 0


def _fine_tune_config(args):
    from .finetune import FineTuneConfig
    given = [flag for flag, v in (("--fine-tune-from", args.fine_tune_from), ("--encoder-lr", args.encoder_lr))
             if v is not None]
    if not args.fine_tune_encoder:
        if given:
            raise CaptionerError(f"{given[0]} needs --fine-tune-encoder")
        return None
    ft = FineTuneConfig()
    return FineTuneConfig(args.fine_tune_from or ft.start, args.encoder_lr or ft.lr, args.workers)


def _evaluate(args) -> None:
    from .evaluation import evaluate, results_path
    from .distributed import choose_device
    m = evaluate(args.checkpoint, args.data, args.split, args.out, beam_size=args.beam_size,
                 max_len=args.max_len, device=str(choose_device(args.device)), mode=args.mode,
                 grounding=args.grounding)
    shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in m.items()
             if k not in ("checkpoint", "grounding")}
    print(json.dumps(shown, indent=1))
    print(f"metrics: {args.out}\ncaptions: {results_path(args.out)}")


def get_caption_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="captioner", description="Caption images with a trained model.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    cp = sub.add_parser("caption", help="caption images, optionally drawing attention figures",
                        description="Caption image files, directories and glob patterns, in batches. "
                        "Prints one 'path<TAB>caption' line per image; --json writes COCO results.",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    cp.add_argument("images", nargs="+", metavar="IMAGE",
                    help="image files, directories of images, or glob patterns such as 'photos/*.jpg' "
                    "(quoted, so that the shell leaves them alone; '**' matches subdirectories)")
    cp.add_argument("--checkpoint", metavar="CKPT", default=None,
                    help="a checkpoint written by `train.py fit` (default: the bundled demo model, "
                    "which knows synthetic coloured shapes only)")
    cp.add_argument("--recursive", action="store_true", help="also take images in subdirectories of a directory")
    cp.add_argument("--beam-size", type=_positive_int, default=3, help="beams per image (1: greedy)")
    cp.add_argument("--max-len", type=_positive_int, default=None,
                    help="most words per caption (default: the checkpoint's training maximum)")
    cp.add_argument("--mode", choices=["expected", "argmax", "sample"], default=None,
                    help="context for hard-attention models: expected (default), argmax or sampled location")
    cp.add_argument("--seed", type=int, default=0, help="random seed of --mode sample")
    cp.add_argument("--json", metavar="OUT", help="write the results at the end as COCO results JSON "
                    "[{image_id, caption, file_name, ...}]; the results are also appended as they are made "
                    "to the --jsonl log, by default OUT with extension .jsonl")
    cp.add_argument("--jsonl", metavar="LOG", help="append one JSON line per captioned image as it is made "
                    "(a killed run keeps them)")
    cp.add_argument("--resume", action="store_true",
                    help="skip the images already in the --jsonl log and append the rest")
    cp.add_argument("--attention", action="store_true",
                    help="put each caption's words and per-word attention maps (grid x grid, rows "
                    "top to bottom) in the JSON")
    cp.add_argument("--figures", metavar="DIR", help="write one attention figure (PNG) per image")
    cp.add_argument("--batch-size", type=_positive_int, default=8, help="images per batch through the model")
    cp.add_argument("--workers", type=_non_negative_int, default=2, help="threads decoding images while the model runs (0: none)")
    cp.add_argument("--device", type=_device, default="auto", help="auto (a GPU if there is one), cpu, cuda or cuda:N")
    cp.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                    help="progress bar on stderr (default: when stderr is a terminal)")
    return p


def _log_path(args) -> str | None:
    if args.jsonl:
        return args.jsonl
    if args.json:
        return (args.json[:-5] if args.json.endswith(".json") else args.json) + ".jsonl"
    return None


def _caption(args) -> None:
    from tqdm import tqdm

    from . import bulk
    from .api import Captioner
    from .assets import demo_checkpoint
    from .data import write_json_atomic
    from .distributed import choose_device
    from .viz import attention_figure, figure_png
    log_path = _log_path(args)
    if args.resume and not log_path:
        raise CaptionerError("--resume needs the log to resume from: give --jsonl LOG (or --json OUT)")
    paths = bulk.expand_inputs(args.images, recursive=args.recursive)
    device = choose_device(args.device)
    if args.checkpoint is None:
        print("using the bundled demo model (synthetic coloured shapes only); "
              "--checkpoint chooses another", file=sys.stderr)
    cap = Captioner.load(args.checkpoint or demo_checkpoint(), device=str(device))
    log = bulk.ResultLog(log_path, resume=args.resume) if log_path else None
    done = log.done if log else {}
    ids = bulk.image_ids(list(dict.fromkeys([*done, *paths])))   # one id type over old and new
    todo = [p for p in paths if p not in done]
    if done:
        print(f"{log_path}: {len(paths) - len(todo)} of {len(paths)} images already captioned, skipped",
              file=sys.stderr)
    if args.figures:
        os.makedirs(args.figures, exist_ok=True)
    bar = tqdm(total=len(todo), unit="img", desc="captioning", file=sys.stderr, dynamic_ncols=True,
               disable=not (sys.stderr.isatty() if args.progress is None else args.progress))

    def on_result(path, image, out, record):
        bar.update()
        tqdm.write(f"{path}\t{out.text}", file=sys.stdout)
        familiarity = record.get("familiarity")
        if familiarity and familiarity.get("unfamiliar"):
            tqdm.write(f"note: {path}: {familiarity.get('message', 'unlike the training images')}", file=sys.stderr)
        if args.figures:
            fig = attention_figure(image, out.words, out.attention, preprocess=cap.encoder_spec.preprocess,
                                   locations=out.locations, title=out.text)
            # Named after the file; after its path where file names repeat (the ids are paths then).
            name = os.path.splitext(os.path.basename(path))[0]
            if record["image_id"] == path:
                name = re.sub(r"[^\w.-]+", "_", path)
            with open(os.path.join(args.figures, f"{name}.png"), "wb") as f:
                f.write(figure_png(fig))

    def on_error(path, error):
        bar.update()
        tqdm.write(f"error: {error}", file=sys.stderr)

    try:
        outcome = bulk.caption_files(cap, todo, ids, batch_size=args.batch_size, workers=args.workers,
                                     attention=args.attention, log=log, on_result=on_result, on_error=on_error,
                                     beam_size=args.beam_size, max_len=args.max_len, mode=args.mode,
                                     seed=args.seed)
    finally:
        bar.close()
        if log:
            log.close()
    if args.json:
        # Every image of this run's inputs that has a result, this run's or the log's, in input order.
        results = {**done, **{r["file_name"]: r for r in outcome.records}}
        write_json_atomic(args.json, [{**results[p], "image_id": ids[p]} for p in paths if p in results])
    if outcome.failed:
        raise CaptionerError(f"{len(outcome.failed)} of {len(paths)} images could not be read")


def _run(handler: Callable, args) -> int:
    try:
        return handler(args) or 0
    except CaptionerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        # A full disk or quota wherever a write was not given its own message.
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        print(f"error: {e.strerror}{f' ({e.filename})' if e.filename else ''}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; finished work is kept (prepare resumes, fit --resume continues, "
              "caption --resume skips the images already captioned)", file=sys.stderr)
        return 130


def train_main(argv: list[str] | None = None) -> int:
    """Entry point of `python train.py` and `captioner-train`."""
    args = get_train_parser().parse_args(argv)
    handler = {"prepare": _prepare, "fit": _fit, "evaluate": _evaluate}[args.command]
    return _run(handler, args)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `captioner`."""
    args = get_caption_parser().parse_args(argv)
    return _run(_caption, args)


if __name__ == "__main__":
    sys.exit(main())
