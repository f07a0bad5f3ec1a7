"""A training run's parts: set up fresh, from `--init`, or resumed, and written to its directory.

`start_run` builds everything `fit` steps through (model, optimizer, scheduler, the objective and
its batch source, the checkpoint saver and the log) from a prepared data directory, a fresh
start, `--init` weights, or `last.pt` of a run to resume. `Run.save` writes a checkpoint in the
format of `models.checkpoint`, and `Run.write_log` a line of metrics.jsonl.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from captioner.data.boxes import BoxTargets, GroundingBoxes
from captioner.data.dataset import CaptionData, TrainingImages
from captioner.errors import CaptionerError
from captioner.evaluation.familiarity import fit_stats as familiarity_stats
from captioner.evaluation.health import verdict
from captioner.models.checkpoint import load_checkpoint
from captioner.models.decoder import AttentionDecoder, DecoderConfig
from captioner.models.encoder import EncoderSpec
from captioner.objectives.scst import SelfCritical, training_scorer
from captioner.options import command_line
from captioner.train import distributed, resilience
from captioner.train.averaging import WeightAverage
from captioner.train.config import Progress, TrainConfig
from captioner.train.finetune import FineTuning
from captioner.train.step import Objective, make_optimizer

log = logging.getLogger(__name__)

# Decoding's map sharpness for soft models trained with --boxes (DecoderConfig.decode_sharpness).
BOXES_SHARPNESS = 3.0


@dataclass
class Run:
    """Everything a training run holds, made once by `start_run`."""

    cfg: TrainConfig
    model_cfg: DecoderConfig
    data: CaptionData
    d: distributed.Dist
    device: torch.device
    model: AttentionDecoder
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.ReduceLROnPlateau
    scaler: torch.amp.GradScaler
    generator: torch.Generator  # hard attention's and SCST's draws, one stream per process
    objective: nn.Module
    source: object  # batches: CaptionData, FineTuning or TrainingImages
    tuning: FineTuning | None
    progress: Progress
    out_dir: str
    started: float  # time.monotonic() of the start, setup of fine-tuning excluded
    familiarity: dict | None = None
    average: WeightAverage | None = None  # --ema: the weights validation scores and checkpoints hold
    metrics: dict = field(default_factory=dict)  # the last validation's
    saver: resilience.CheckpointSaver = field(default_factory=resilience.CheckpointSaver)
    notes: resilience.FaultLog | None = None
    last_save: float = 0.0
    log_file: object = None

    @property
    def command(self) -> str:
        """The `train.py fit` command line that gives this run's configuration."""
        return " ".join(
            [
                "python train.py fit --data",
                self.data.dir,
                "--out",
                self.out_dir,
                *command_line(self.model_cfg),
                *command_line(self.cfg),
            ]
        )

    @property
    def last_path(self) -> str:
        return os.path.join(self.out_dir, "last.pt")

    @property
    def best_path(self) -> str:
        return os.path.join(self.out_dir, "best.pt")

    def write_log(self, record: dict) -> None:
        """One line of metrics.jsonl (rank 0); a full disk loses log lines, not the run."""
        if self.log_file is None:
            return
        try:
            self.log_file.write(json.dumps({**record, "time": round(time.monotonic() - self.started, 2)}) + "\n")
            self.log_file.flush()
        except OSError:
            pass

    def checkpoint(self) -> dict:
        """This moment of the run in the checkpoint format (`models.checkpoint`)."""
        ck = {
            "model": (self.average or self.model).state_dict(),
            "decoder": self.model_cfg.to_dict(),
            "train": self.cfg.to_dict(),
            "vocab": self.data.vocab.words,
            "encoder": self.data.encoder.to_dict(),
            "max_len": self.data.max_len,
            "step": self.progress.step,
            "progress": asdict(self.progress),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "metrics": self.metrics,
            "attention": verdict(self.metrics.get("attention_health")),
            "rng": {
                "torch": torch.get_rng_state(),
                "generator": self.generator.get_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            },
            "data": {"dir": os.path.abspath(self.data.dir), "fingerprint": self.data.encoder.fingerprint},
            "familiarity": self.familiarity,
            "command": self.command,
        }
        if self.average:
            ck["training_model"] = self.model.state_dict()  # the raw weights the optimizer steps, for --resume
        if self.tuning:
            ck["encoder_state"] = self.tuning.encoder.encoder_state()  # the trained layers, trunk names
        return ck

    def save(self, path: str, final: bool = False) -> None:
        """Save a checkpoint (rank 0); a failed save is reported, and raised by `fit` if it was the final one."""
        if self.d.main and not self.saver.save(self.checkpoint(), path):
            then = "fit ends with this error" if final else "training goes on and retries at the next save"
            self.notes.warn(
                "save_failed", f"{self.saver.failed[path]}; {then}", step=self.progress.step, show=not final
            )
        if path == self.last_path:
            self.last_save = time.monotonic()


def start_run(
    data_dir: str,
    out_dir: str,
    model_cfg: DecoderConfig | None,
    cfg: TrainConfig,
    *,
    resume: bool,
    device: str,
    progress_bar: bool,
) -> Run:
    """Set a run up: fresh, from cfg.init's weights, or resumed from out_dir/last.pt."""
    d, dev = distributed.setup(device)
    data = CaptionData(data_dir)
    last_path = os.path.join(out_dir, "last.pt")
    ck = init = None
    if resume:
        if not os.path.exists(last_path):
            raise CaptionerError(f"--resume: {last_path} does not exist; nothing to resume")
        ck = load_checkpoint(last_path, map_location=dev)
        model_cfg, cfg = _resume_config(ck, data, cfg, last_path)
    elif cfg.init:
        init = _init_checkpoint(cfg.init, data, dev)
        given = model_cfg.decode_sharpness if model_cfg else None  # how to decode is not the weights' to say
        model_cfg = DecoderConfig.from_dict(init["decoder"])
        model_cfg.decode_sharpness = given or model_cfg.decode_sharpness
    elif cfg.objective == "scst":
        raise CaptionerError(
            "--objective scst starts from a trained model: pass --init RUN/best.pt "
            "(or --resume to continue a self-critical run)"
        )
    model_cfg = DecoderConfig(**{**(model_cfg or DecoderConfig(0)).to_dict(), "vocab_size": len(data.vocab)})
    if model_cfg.word_query is None:  # with boxes, every object word's map is taught where to be
        model_cfg.word_query = bool(cfg.boxes) and not cfg.paper
    if model_cfg.decode_sharpness is None:  # measured with boxes, soft: docs/results.md
        boxed_soft = cfg.boxes and not cfg.paper and model_cfg.attention == "soft"
        model_cfg.decode_sharpness = BOXES_SHARPNESS if boxed_soft else 1.0
    _choose_objective_data(data, cfg, d)
    if cfg.boxes:
        data.box_targets = box_targets(data, cfg.boxes, d)
    torch.manual_seed(cfg.seed)
    model = AttentionDecoder.from_config(model_cfg)
    model.set_feature_stats(*data.feature_stats())
    model = model.to(dev)
    optimizer = make_optimizer(model, cfg.lr)
    started, tuning = time.monotonic(), None
    if cfg.fine_tune is not None:
        tuning = FineTuning(data, cfg.fine_tune, d, dev, progress=progress_bar and d.main)
        if ck is not None:
            tuning.encoder.load_encoder_state(ck["encoder_state"], last_path)
        optimizer.add_param_group({"params": list(tuning.parameters()), "lr": cfg.fine_tune.lr})
        started = time.monotonic()  # the one-off pool4 cache is preparation, like prepare's: not training time
    run = Run(
        cfg,
        model_cfg,
        data,
        d,
        dev,
        model,
        optimizer,
        torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", factor=0.5, patience=2),
        torch.amp.GradScaler(dev.type, enabled=cfg.amp == "fp16" and dev.type == "cuda"),
        torch.Generator(device=dev).manual_seed(cfg.seed + 1 + d.rank),
        objective=None,
        source=None,
        tuning=tuning,
        progress=Progress(),
        out_dir=out_dir,
        started=started,
        last_save=time.monotonic(),
    )
    if init is not None:
        model.load_state_dict(init["model"])
    if cfg.ema:
        run.average = WeightAverage(model, cfg.ema)
    if ck is not None:
        _restore(run, ck)
    set_objective(run)
    _open_files(run, resumed=ck is not None)
    run.familiarity = _familiarity(run, ck)
    return run


def _choose_objective_data(data: CaptionData, cfg: TrainConfig, d: distributed.Dist) -> None:
    """Read the views' features only where the consistency uses them (no extra I/O otherwise).
    A fine-tuned encoder makes its own views (`models.tuned.TunedEncoder`) once it trains."""
    decoder_alone = cfg.fine_tune is None or cfg.fine_tune.after > 0
    if not (cfg.consistency > 0 and cfg.objective == "xe" and decoder_alone):
        data.turned = None
    elif data.turned is not None:
        data.turned_share = cfg.consistency_share
    elif d.main:
        log.warning(
            f"{data.dir} has no features of the images' views (prepared with --no-rotated or by an older "
            "version), so attention trains without its consistency and its heatmaps may not rest on the "
            "objects they name; run prepare again into a new directory to add them"
        )


def box_targets(data: CaptionData, path: str, d: distributed.Dist) -> BoxTargets:
    """`fit --boxes`: where the training captions' object words should look."""
    targets = BoxTargets(data, GroundingBoxes(path), data.encoder.preprocess, data.encoder.grid)
    if not targets.words:
        raise CaptionerError(
            f"--boxes {path}: no word of the training captions names an object boxed there "
            f"(the file must hold the training images of {data.dir}, by image id)"
        )
    if d.main:
        log.info(
            f"--boxes: {targets.words} words of the training captions name a boxed object; they also learn where it is"
        )
    return targets


def _restore(run: Run, ck: dict) -> None:
    """Put a resumed run's saved state back: weights, optimizer, schedule, progress, random streams."""
    run.model.load_state_dict(ck.get("training_model", ck["model"]))
    if run.average:
        run.average.load_state_dict(ck["model"])
    run.optimizer.load_state_dict(ck["optimizer"])
    run.scheduler.load_state_dict(ck["scheduler"])
    run.progress = Progress(**ck["progress"])
    if run.progress.cooldown_from is not None:  # this invocation has its own budget, and its own cooldown
        for group, lr in zip(run.optimizer.param_groups, run.progress.cooldown_from):
            group["lr"] = lr
        run.progress.cooldown_from = None
    run.metrics = ck.get("metrics") or {}
    torch.set_rng_state(ck["rng"]["torch"].cpu())
    run.generator.set_state(ck["rng"]["generator"].cpu())
    if ck["rng"]["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in ck["rng"]["cuda"]])


def set_objective(run: Run) -> None:
    """The loss as a module (DDP-wrapped under torchrun) and where its batches come from, for the
    current epoch: until the encoder trains, the decoder's alone on the cached features."""
    cfg, model = run.cfg, run.model
    tuned = run.tuning is not None and run.progress.epoch >= cfg.fine_tune.after
    run.objective, run.source = (
        Objective(model, cfg, run.tuning.encoder if tuned else None, run.data.box_targets),
        run.tuning if tuned else run.data,
    )
    if cfg.objective == "scst":
        if run.tuning:
            raise CaptionerError("--objective scst does not fine-tune the encoder; leave out --fine-tune-encoder")
        run.objective = SelfCritical(model, cfg.scst, training_scorer(run.data, cfg.scst.end_token), run.data.max_len)
        run.source = TrainingImages(run.data)
    if run.d.active:
        run.objective = DistributedDataParallel(
            run.objective, device_ids=[run.device.index] if run.device.type == "cuda" else None
        )
    model.fused = cfg.fused
    if cfg.compile:
        model.compile_step()


def _open_files(run: Run, resumed: bool) -> None:
    """The log (rank 0), the warnings, and the saver that knows which checkpoints are whole."""
    if run.d.main:
        os.makedirs(run.out_dir, exist_ok=True)
        run.log_file = open(os.path.join(run.out_dir, "metrics.jsonl"), "a", encoding="utf-8")
    run.notes = resilience.FaultLog(run.write_log, show=run.d.main)
    if resumed:
        run.saver.good[run.last_path] = run.progress.step
        if os.path.exists(run.best_path):
            run.saver.good[run.best_path] = run.progress.best_step


def _familiarity(run: Run, ck: dict | None) -> dict | None:
    """The training features' statistics ("unlike the training images"), computed once per run.

    A resumed run keeps the statistics it saved (same data and seed). A fine-tuned encoder's
    features are not the cache's: its checkpoints get theirs when `fit` ends.
    """
    if run.tuning is not None or not run.d.main:
        return None
    if ck is not None and ck.get("familiarity") is not None:
        return ck["familiarity"]
    stats = familiarity_stats(run.data, seed=run.cfg.seed)
    return stats.to_dict() if stats is not None else None


def _resume_config(ck: dict, data: CaptionData, cfg: TrainConfig, path: str) -> tuple[DecoderConfig, TrainConfig]:
    """The saved run's configs; what may change on resume is how long to go on and how often to save."""
    if ck["data"]["fingerprint"] != data.encoder.fingerprint or ck["vocab"] != data.vocab.words:
        raise CaptionerError(f"--resume: {path} was trained on other data than {data.dir}")
    saved = TrainConfig.from_dict(ck["train"])
    if cfg.objective == "scst" and saved.objective != "scst":
        raise CaptionerError(
            f"--resume --objective scst: {path} is a cross-entropy run; start self-critical "
            f"training from it with --init {os.path.join(os.path.dirname(path), 'best.pt')} "
            "and a new --out"
        )
    # Encoder fine-tuning: the layers and their learning rate are the saved ones; workers may change.
    if cfg.fine_tune is not None and (
        saved.fine_tune is None
        or (cfg.fine_tune.start, cfg.fine_tune.lr) != (saved.fine_tune.start, saved.fine_tune.lr)
    ):
        raise CaptionerError(
            f"--resume: {path} was trained {'with other' if saved.fine_tune else 'without'} "
            "--fine-tune-encoder settings; resume without those flags to continue as it was"
        )
    if saved.fine_tune is not None and "encoder_state" not in ck:
        raise CaptionerError(f"--resume: {path} lacks the encoder_state its fine-tuning settings call for")
    fine_tune = saved.to_dict()["fine_tune"]
    if fine_tune and cfg.fine_tune is not None:
        fine_tune["workers"] = cfg.fine_tune.workers
    return DecoderConfig.from_dict(ck["decoder"]), TrainConfig.from_dict(
        {
            **saved.to_dict(),
            "epochs": cfg.epochs,
            "max_minutes": cfg.max_minutes,
            "checkpoint_every": cfg.checkpoint_every,
            "checkpoint_minutes": cfg.checkpoint_minutes,
            "fine_tune": fine_tune,
        }
    )


def _init_checkpoint(path: str, data: CaptionData, dev) -> dict:
    """The checkpoint of --init, refused unless it was trained on this vocabulary and encoder."""
    try:
        ck = load_checkpoint(path, map_location=dev)
    except CaptionerError as e:
        raise CaptionerError(f"--init: {e}") from None
    if ck["vocab"] != data.vocab.words:
        raise CaptionerError(
            f"--init: {path} has a vocabulary of {len(ck['vocab'])} words that differs from "
            f"{data.dir}'s ({len(data.vocab)} words); start from a model trained on this data"
        )
    fingerprint = ck.get("data", {}).get("fingerprint") or EncoderSpec.from_dict(ck["encoder"]).fingerprint
    if fingerprint != data.encoder.fingerprint:
        raise CaptionerError(
            f"--init: {path} was trained on features of encoder {fingerprint}, but {data.dir} "
            f"holds features of encoder {data.encoder.fingerprint}"
        )
    return ck
