"""What a run starts from: every setting `fit` derives from others, and with `--init` or `--resume` a checkpoint.

The settings are settled in one place before anything is built; `DERIVED` says how each derived default is settled
(and is what `fit --help` says of it). What needs the data itself is refused where the data is read. A resumed run's
derived defaults are settled as a fresh run's, so that a setting its checkpoint lacks is derived, not left None.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace

import torch

from captioner.data.dataset import CaptionData
from captioner.errors import CaptionerError
from captioner.io import read_torch
from captioner.models.checkpoint import load_checkpoint
from captioner.models.decoder import DecoderConfig
from captioner.objectives.scst import LR as SCST_LR
from captioner.objectives.terms import TermsConfig
from captioner.options import command_line
from captioner.train import distributed
from captioner.train.checkpoints import Live, rank_streams_path
from captioner.train.config import XE_LR, ProcessConfig, Progress, TrainConfig
from captioner.train.finetune import DECODER_FIRST
from captioner.train.log import FaultLog

logger = logging.getLogger(__name__)


def checked_checkpoint(path: str, data: CaptionData, device: torch.device, flag: str) -> dict:
    """The checkpoint of --init or --resume, refused unless it was trained on this data's vocabulary and encoder."""
    try:
        ck = load_checkpoint(path, map_location=device)
    except CaptionerError as e:
        raise CaptionerError(f"{flag}: {e}") from None
    if ck["vocab"] != data.vocab.words:
        raise CaptionerError(
            f"{flag}: {path} has a vocabulary of {len(ck['vocab'])} words that differs from {data.dir}'s "
            f"({len(data.vocab)} words); start from a model trained on this data"
        )
    fingerprint = (ck.get("data") or {}).get("fingerprint") or ck["encoder"].get("fingerprint", "")
    if fingerprint != data.encoder.fingerprint:
        raise CaptionerError(
            f"{flag}: {path} was trained on features of encoder {fingerprint}, but {data.dir} holds features "
            f"of encoder {data.encoder.fingerprint}"
        )
    return ck


def restore(live: Live, ck: dict, out_dir: str, notes: FaultLog) -> Progress:
    """Put a resumed run's saved state back: weights, optimizer, schedule, random streams; its progress."""
    live.decoder.load_state_dict(ck.get("training_model", ck["model"]))
    if live.average:
        live.average.load_state_dict(ck["model"])
    if live.tuning is not None:
        live.tuning.encoder.load_encoder_state(ck["encoder_state"], os.path.join(out_dir, "last.pt"))
    _load_optimizer(live.optimizer, ck["optimizer"])
    live.scheduler.load_state_dict(ck["scheduler"])
    progress = Progress(**ck["progress"])
    if progress.cooldown_from is not None:  # this invocation has its own budget, and its own cooldown
        for group, lr in zip(live.optimizer.param_groups, progress.cooldown_from):
            group["lr"] = _rate(group["lr"], lr)
        progress.cooldown_from = None
    _restore_streams(live.generator, ck["rng"], out_dir, progress.step, notes)
    return progress


# The settings that say how this run's optimizer steps (its device, its CUDA graphs), not the saved run's.
FLAGS = ("foreach", "fused", "capturable", "differentiable")


def _load_optimizer(optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """The saved moments and learning rates, in this run's optimizer as it was made: its flags stay
    (a run saved on a CPU and resumed on a GPU stays capturable, for its graphs), and each saved rate
    goes into this run's rate (a tensor the graphs read stays that tensor)."""
    groups, rates = saved["param_groups"], [g["lr"] for g in optimizer.param_groups]
    if len(groups) == len(optimizer.param_groups):  # (else load_state_dict says what differs)
        # Given before loading: they also place the saved step counts (on the device if capturable or fused).
        ours = [{k: g[k] for k in FLAGS if k in g} for g in optimizer.param_groups]
        groups = [{**g, **flags} for g, flags in zip(groups, ours)]
    optimizer.load_state_dict({**saved, "param_groups": groups})
    for group, rate in zip(optimizer.param_groups, rates):
        group["lr"] = _rate(rate, group["lr"])


def _rate(rate, value):
    """`value` as this run holds a learning rate: written into `rate` where that is a tensor, else a float."""
    if torch.is_tensor(rate):
        return rate.copy_(value) if torch.is_tensor(value) else rate.fill_(value)
    return float(value)


def _restore_streams(generator: torch.Generator, rng: dict, out_dir: str, step: int, notes) -> None:
    """The random streams of a resumed run, each rank's its own: as saved where they fit this rank,
    device and GPU count; where they do not (another number of processes, a run saved on a GPU resumed
    on a CPU, fewer GPUs), reseeded from (seed, rank, step), with a note in the log."""
    here = distributed.current()
    rank, world = here.rank, here.world
    own, missing = _saved_streams(rng, out_dir, rank, world, step)
    seed = rank_seed(torch.initial_seed(), rank, step)  # the run's seed, read before a saved state replaces it
    if own is None:
        torch.default_generator.manual_seed(seed)
    else:
        torch.set_rng_state(own["torch"].cpu())
    reseeded = [missing] if missing else []
    state = own["generator"].cpu() if own is not None else None
    if state is not None and state.numel() == generator.get_state().numel():
        generator.set_state(state)
    else:
        generator.manual_seed(rank_seed(generator.initial_seed(), rank, step))
        if state is not None:
            reseeded.append(f"the terms' generator (saved on another kind of device, now {generator.device.type})")
    saved_cuda = own["cuda"] if own is not None else []
    here = _restore_cuda(saved_cuda, seed)
    if own is not None and len(saved_cuda) != here:
        reseeded.append(f"the CUDA streams ({len(saved_cuda)} saved, {here} GPUs here)")
    if reseeded:
        notes.warn(
            "rng_reseeded",
            f"--resume: reseeded {' and '.join(reseeded)}: the run goes on, but not with the draws it would have had",
            step=step,
            local=rank > 0 and rng.get("world", world) == world,  # this rank's own: rank 0 cannot say it
        )


def _saved_streams(rng: dict, out_dir: str, rank: int, world: int, step: int) -> tuple[dict | None, str]:
    """This rank's streams as saved (rank 0's in last.pt, each other rank's beside it), or None and why not."""
    saved_world = rng.get("world", world)  # (not recorded before each rank saved its own)
    if saved_world != world:
        return None, f"every rank's random streams (saved by {saved_world} processes, resumed by {world})"
    if rank == 0:
        return rng, ""
    path = rank_streams_path(out_dir, rank)
    try:
        own = read_torch(path, name=path, kind="random streams") if os.path.isfile(path) else {}
    except CaptionerError:  # truncated: as if it were not there
        own = {}
    if (own.get("step"), own.get("world")) != (step, world):
        return None, f"rank {rank}'s random streams ({path} holds none of step {step})"
    return own["rng"], ""


def _restore_cuda(saved: list, seed: int) -> int:
    """Each GPU's default generator as `saved`, those beyond it seeded with `seed`; returns the GPU count.

    Every call names its GPU's generator: entering a device (`torch.cuda.device`) would open a CUDA
    context on it, and so on every GPU of the machine."""
    here = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if here:
        torch.cuda.init()  # fills torch.cuda.default_generators; enters no device
    for i in range(here):
        if i < len(saved):
            torch.cuda.default_generators[i].set_state(saved[i].cpu())
        else:
            torch.cuda.default_generators[i].manual_seed(seed)
    return here


def rank_seed(base: int, rank: int, step: int) -> int:
    """A seed for each rank at each step of a run seeded `base`: reseeded streams differ across ranks."""
    return hash((base, rank, step)) & (2**63 - 1)


def start_from(job, data: CaptionData, device) -> tuple[dict | None, dict | None, dict]:
    """The checkpoints a run starts from (--init's, the resumed last.pt), each checked against the data, and how the
    run began as its checkpoints record it: {"init", "boxes", "command"} (a resumed run keeps its first --init and
    command line, and reads its boxes again)."""
    init, boxes, out_dir = job.init, job.boxes, job.out
    began = {"init": init, "boxes": boxes, "command": job.command}
    if not job.resume:
        return (checked_checkpoint(init, data, device, "--init") if init else None), None, began
    last = os.path.join(out_dir, "last.pt")
    saved = checked_checkpoint(last, data, device, "--resume")
    if saved["train"].get("fine_tune") and "encoder_state" not in saved:
        raise CaptionerError(f"--resume: {last} lacks the encoder_state its fine-tuning settings call for")
    trained_with = saved["data"].get("boxes")
    if bool(trained_with) != bool(boxes):
        raise CaptionerError(
            f"--resume: {last} was trained with --boxes {trained_with}: pass it again"
            if trained_with
            else f"--resume: {last} was trained without --boxes: leave it out, or start a new run from it "
            "with --init OUT/best.pt"
        )
    return None, saved, {**began, "init": saved["data"].get("init"), "command": saved.get("command")}


BOXES_SHARPNESS = 3.0  # decoding's map sharpness for soft models trained with --boxes, and any with --word-maps
PAPER = {"alpha_c": 1.0, "consistency": 0.0}  # --paper-objective: eq. (14) with λ = 1, no term of ours
OURS = {"alpha_c": 0.3, "consistency": 1.0}
DROPOUT = {"soft": 0.2, "hard": 0.5}
DERIVED = {  # each derived default's rule, as `fit --help` shows it
    "lr": f"{XE_LR:g} for xe, {SCST_LR:g} for scst",
    "dropout": f"{DROPOUT['soft']:g} for soft attention, {DROPOUT['hard']:g} for hard",
    "alpha_c": f"{OURS['alpha_c']:g}; {PAPER['alpha_c']:g}, the paper's, with --paper-objective",
    "consistency": f"{OURS['consistency']:g}; {PAPER['consistency']:g}, off, with --paper-objective or where the data "
    "has no views' features and no fine-tuned encoder makes them",
    "word_query": "on with --boxes or --word-maps, unless --paper-objective",
    "decode_sharpness": f"{BOXES_SHARPNESS:g} for soft attention with --boxes and for either with --word-maps "
    "(unless --paper-objective), else 1; with --init, the checkpoint's",
    "after": f"{DECODER_FIRST} from scratch, 0 with --init",
}


@dataclass(frozen=True)
class Start:
    """What a run starts from: `encoder_dim` is the data's feature size D (None keeps the config's); without `views`
    (the views' features) and without a fine-tuned encoder to make its own, the consistency is settled as 0; `boxes`
    (`fit --boxes` or `--word-maps`) sets the word query's and the decoding sharpness's defaults; `init` and `saved`
    are migrated."""

    vocab_size: int
    encoder_dim: int | None = None
    views: bool = True
    boxes: bool = False
    init: dict | None = None
    saved: dict | None = None


def settle(
    model: DecoderConfig | None, cfg: TrainConfig, start: Start, device: torch.device
) -> tuple[DecoderConfig, TrainConfig]:
    """The settled (decoder, training) configs of a run on `device`. With --init its checkpoint sets the decoder's
    sizes; on resume the saved run sets them all, and the options given otherwise are warned of. Raises
    CaptionerError for options that cannot train together, or that contradict the run being resumed."""
    init, saved, views, boxes = start.init, start.saved, start.views, start.boxes
    if saved is not None:
        settled = _derived(*_resumed(saved, cfg), device=device, init=None, views=views, boxes=boxes)
        _warn_overruled((model, cfg), settled)
        return settled
    _refuse(model, cfg, init)
    given = model or DecoderConfig(start.vocab_size)
    if init is not None:  # the checkpoint's sizes; how to decode is not the weights' to say
        model = replace(DecoderConfig(**init["decoder"]), decode_sharpness=given.decode_sharpness)
    model = replace(model or given, vocab_size=start.vocab_size)
    if start.encoder_dim is not None and init is None:
        model = replace(model, encoder_dim=start.encoder_dim)
    return _derived(model, cfg, device=device, init=init, views=views, boxes=boxes)


def _derived(
    model: DecoderConfig, cfg: TrainConfig, *, device: torch.device, init: dict | None, views: bool, boxes: bool
) -> tuple[DecoderConfig, TrainConfig]:
    """The configs with every derived default settled (`DERIVED`); values already set are kept."""
    terms = _terms(cfg.terms, views or cfg.fine_tune is not None)
    taught = boxes and not terms.paper  # attention taught where words lie
    sharpened = taught and (model.attention == "soft" or terms.word_maps)
    model = replace(
        model,
        dropout=_given(model.dropout, DROPOUT[model.attention]),
        word_query=_given(model.word_query, taught),
        decode_sharpness=_given(
            model.decode_sharpness,
            DecoderConfig(**init["decoder"]).decode_sharpness
            if init is not None
            else BOXES_SHARPNESS
            if sharpened
            else 1.0,
        ),
    )
    fine_tune = cfg.fine_tune
    if fine_tune is not None:
        fine_tune = replace(fine_tune, after=_given(fine_tune.after, 0 if init is not None else DECODER_FIRST))
    lr = _given(cfg.optim.lr, SCST_LR if cfg.objective == "scst" else XE_LR)
    optim, process = replace(cfg.optim, lr=lr), _process(cfg.process, device)
    return model, replace(cfg, optim=optim, process=process, terms=terms, fine_tune=fine_tune)


def _refuse(model: DecoderConfig | None, cfg: TrainConfig, init: dict | None) -> None:
    """Combinations of options that cannot train, refused before anything is built."""
    if cfg.objective == "scst" and init is None:
        raise CaptionerError(
            "--objective scst starts from a trained model: pass --init RUN/best.pt "
            "(or --resume to continue a self-critical run)"
        )
    if cfg.objective == "scst" and cfg.fine_tune is not None:
        raise CaptionerError("--objective scst does not fine-tune the encoder; leave out --fine-tune-encoder")
    attention = init["decoder"]["attention"] if init is not None else (model or DecoderConfig(0)).attention
    if cfg.terms.boxes_choice_weight > 0 and attention == "hard":
        raise CaptionerError(
            "--boxes-choice-weight teaches soft attention at the model's own words; hard attention trains without "
            "it: leave it out"
        )


def _given(value, default):
    return default if value is None else value


def _terms(t: TermsConfig, views: bool) -> TermsConfig:
    if t.paper:
        contradicted = [
            f"--{k.replace('_', '-')} {getattr(t, k):g}" for k, v in PAPER.items() if getattr(t, k) not in (None, v)
        ]
        if contradicted:
            raise CaptionerError(
                f"--paper-objective trains with --alpha-c 1 and --consistency 0: leave out {', '.join(contradicted)} "
                "or --paper-objective"
            )
    if t.paper and t.word_maps:
        raise CaptionerError("--paper-objective trains no attention term of ours: leave out --word-maps")
    values = PAPER if t.paper else OURS
    t = replace(t, **{k: _given(getattr(t, k), values[k]) for k in values})
    if t.consistency > 0 and not views:
        logger.warning(
            "the data directory has no features of the images' views (prepared with --no-views or by an older "
            "version), so attention trains without its consistency (--consistency 0) and its heatmaps may not rest "
            "on the objects they name; run prepare again into a new directory to add them"
        )
        t = replace(t, consistency=0.0)
    return t


def _process(p: ProcessConfig, device: torch.device) -> ProcessConfig:
    """`--shapes auto`: packed on a CPU, fixed on a GPU or with --compile."""
    shapes = p.shapes
    if shapes == "auto":
        shapes = "fixed" if device.type == "cuda" or p.compile else "packed"
    elif p.compile and shapes == "packed":
        raise CaptionerError("--compile trains with fixed shapes: leave out --shapes packed")
    return replace(p, shapes=shapes)


def _resumed(saved: dict, cfg: TrainConfig) -> tuple[DecoderConfig, TrainConfig]:
    """A resumed run's configs, before its derived defaults are settled: the saved ones, with how this
    process runs them taken from the command (--shapes auto then follows this device)."""
    kept = TrainConfig.from_dict(saved["train"])
    _refuse_resumed(kept, cfg)
    return DecoderConfig(**saved["decoder"]), replace(kept, process=cfg.process)


def _warn_overruled(given: tuple, settled: tuple) -> None:
    """Warn of the options given (decoder's, training's) that a resumed run leaves out, keeping its own."""
    overruled = []
    for mine, kept in zip(given, settled):
        if mine is not None:
            held = set(_options(kept))
            overruled += [o for o in _options(mine) if o not in held]
    if overruled:
        logger.warning(
            f"--resume goes on with the run as it was configured, so it leaves out {', '.join(overruled)}; "
            "to train with them, start a new run from it: --init OUT/best.pt and a new --out"
        )


def _options(cfg) -> list[str]:
    """`options.command_line(cfg)`, one option and its values to each item ("--lr 0.5")."""
    out: list[str] = []
    for arg in command_line(cfg):
        if arg.startswith("--"):
            out.append(arg)
        else:
            out[-1] += f" {arg}"
    return out


def _refuse_resumed(kept: TrainConfig, cfg: TrainConfig) -> None:
    if cfg.objective == "scst" and kept.objective != "scst":
        raise CaptionerError(
            "--resume --objective scst: --out holds a cross-entropy run; start self-critical training from it "
            "with --init OUT/best.pt and a new --out"
        )
    # Encoder fine-tuning: the layers and their learning rate are the saved ones.
    mine, theirs = cfg.fine_tune, kept.fine_tune
    if mine is not None and (theirs is None or (mine.start, mine.lr) != (theirs.start, theirs.lr)):
        raise CaptionerError(
            f"--resume: --out holds a run trained {'with other' if theirs else 'without'} --fine-tune-encoder "
            "settings; resume without those flags to continue as it was"
        )
