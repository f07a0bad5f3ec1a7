"""Every setting `fit` derives from others, settled in one place before anything is built.

`DERIVED` says how each derived default is settled (and is what `fit --help` says of it). Combinations that cannot
train, and options that contradict a resumed run, are refused here, before anything is built; what needs the data
itself is refused where the data is read. A resumed run keeps its saved configs but takes `config.ProcessConfig`
from the command, warning of the command's other settings; its derived defaults are then settled as a fresh run's,
so that a setting its checkpoint lacks is derived, not left None.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from captioner.errors import CaptionerError
from captioner.models.decoder import DecoderConfig
from captioner.objectives.scst import LR as SCST_LR
from captioner.objectives.terms import TermsConfig
from captioner.options import command_line
from captioner.train.config import XE_LR, ProcessConfig, TrainConfig
from captioner.train.finetune import DECODER_FIRST

log = logging.getLogger(__name__)
BOXES_SHARPNESS = 3.0  # decoding's map sharpness for soft models trained with --boxes
PAPER = {"alpha_c": 1.0, "consistency": 0.0}  # --paper-objective: eq. (14) with λ = 1, no term of ours
OURS = {"alpha_c": 0.3, "consistency": 1.0}
DROPOUT = {"soft": 0.2, "hard": 0.5}
DERIVED = {  # each derived default's rule, as `fit --help` shows it
    "lr": f"{XE_LR:g} for xe, {SCST_LR:g} for scst",
    "dropout": f"{DROPOUT['soft']:g} for soft attention, {DROPOUT['hard']:g} for hard",
    "alpha_c": f"{OURS['alpha_c']:g}; {PAPER['alpha_c']:g}, the paper's, with --paper-objective",
    "consistency": f"{OURS['consistency']:g}; {PAPER['consistency']:g}, off, with --paper-objective or where the "
    "data has no views' features and no fine-tuned encoder makes them",
    "word_query": "on with --boxes, unless --paper-objective",
    "decode_sharpness": f"{BOXES_SHARPNESS:g} for soft attention with --boxes (unless --paper-objective), else 1; "
    "with --init, the checkpoint's",
    "after": f"{DECODER_FIRST} from scratch, 0 with --init",
}


@dataclass(frozen=True)
class Start:
    """What a run starts from: `encoder_dim` is the data's feature size D (None keeps the config's); without `views`
    (the views' features) and without a fine-tuned encoder to make its own, the consistency is settled as 0; `boxes`
    (`fit --boxes`) sets the word query's and the decoding sharpness's defaults; `init` and `saved` are migrated."""

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
    sizes; on resume the saved run sets them all, and the options given otherwise are warned of.

    Raises:
        CaptionerError: options that cannot train together, or that contradict the run being resumed.
    """
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
    soft_boxes = boxes and not terms.paper
    hard = model.attention == "hard"
    model = replace(
        model,
        dropout=_given(model.dropout, DROPOUT[model.attention]),
        word_query=_given(model.word_query, soft_boxes),
        decode_sharpness=_given(
            model.decode_sharpness,
            DecoderConfig(**init["decoder"]).decode_sharpness
            if init is not None
            else BOXES_SHARPNESS
            if soft_boxes and not hard
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
    values = PAPER if t.paper else OURS
    t = replace(t, **{k: _given(getattr(t, k), values[k]) for k in values})
    if t.consistency > 0 and not views:
        log.warning(
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
        log.warning(
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
    """Options that contradict the run being resumed."""
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
