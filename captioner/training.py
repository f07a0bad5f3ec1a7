"""`fit`: teacher-forced training on cached features, validated by generation each epoch.

Checkpoints (`last.pt` every epoch, every `checkpoint_minutes` and every `checkpoint_every` steps,
`best.pt` on a new best
validation score) hold everything needed to resume exactly: model, optimizer, scheduler,
step, epoch, position in the epoch, RNG states, the REINFORCE baseline. Batches of an epoch
are a function of (seed, epoch), so a resumed run replays the rest of the epoch it was in.
Under `torchrun` the same loop runs DistributedDataParallel: each process takes its share of
every global batch; validation is split over processes and gathered; rank 0 logs and saves.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field, fields

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from . import distributed, faults
from .checkpoint import load_checkpoint
from .data import CaptionData
from .decoder import AttentionDecoder, DecoderConfig, sequence_loss, sequence_terms
from .encoder import EncoderSpec
from .errors import CaptionerError
from .evaluation import caption_split, score_validation
from .health import ADVICE, attention_health, problems
from .health import summary as health_summary
from .finetune import FineTuneConfig, FineTuning, add_tuned_familiarity
from .familiarity import fit_stats as familiarity_stats
from .equivariance import equivariance_term
from .reinforce import HardAttentionConfig, hard_attention_loss, update_baseline
from .scst import LR as SCST_LR, ScstConfig, SelfCritical, TrainingImages, training_scorer

AMP_DTYPES = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def make_optimizer(model: torch.nn.Module, lr: float) -> torch.optim.Adam:
    """Adam, fused into one kernel per step (CPU and CUDA): on CPU the unfused update of the
    decoder's 15M parameters took 100 ms of a 500 ms step, the fused one 6 ms."""
    return torch.optim.Adam(model.parameters(), lr=lr, fused=True)


@dataclass
class TrainConfig:
    """Optimisation settings; saved in every checkpoint."""
    epochs: int = 30
    batch_size: int = 32                 # per process (SCST: images, each sampled scst.samples times)
    lr: float | None = None              # None: 1e-3 for xe, scst.LR for scst
    grad_clip: float = 5.0
    # λ of the doubly stochastic penalty, eq. (14); the paper's value is 1. Off by default:
    # Σ_i (1 − Σ_t α_ti)² over 196 cells is smallest when every map is spread evenly, and
    # measured on synthetic scenes it halves pointing accuracy (README, 'Soft and hard').
    alpha_c: float = 0.0
    # λ of the soft attention's half-turn equivariance term (equivariance.py), used when the data
    # directory holds the turned images' features; 0: off (the paper's objective).
    equivariance: float = 1.0
    max_minutes: float | None = None
    patience: int = 8                    # validations without improvement before stopping
    metric: str = "CIDEr"                # early stopping / best.pt on this validation metric
    val_beam_size: int = 3
    val_images: int | None = 5000        # cap on validation images per epoch
    checkpoint_every: int = 0            # also save last.pt every N steps (0: off)
    checkpoint_minutes: float = 0.5      # and when this long has passed since the last save (0: off)
    log_every: int = 20
    seed: int = 0
    amp: str = "none"                    # none | bf16 | fp16 (autocast; fp16 uses a GradScaler on CUDA)
    compile: bool = False                # torch.compile the decoder's recurrent step
    hard: HardAttentionConfig = field(default_factory=HardAttentionConfig)
    fine_tune: FineTuneConfig | None = None  # train the encoder's last layers too (finetune.py); None: frozen
    # --- objective (issue 11): "xe" cross-entropy, or "scst" self-critical from `init` or a resume
    objective: str = "xe"
    init: str | None = None              # start from this checkpoint's weights (fresh optimizer)
    scst: ScstConfig = field(default_factory=ScstConfig)

    def __post_init__(self):
        if self.objective not in ("xe", "scst"):
            raise ValueError(f"objective must be 'xe' or 'scst', got {self.objective!r}")
        if self.lr is None:
            self.lr = SCST_LR if self.objective == "scst" else 1e-3

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        kw = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        kw["hard"] = HardAttentionConfig(**d.get("hard", {}))
        kw["fine_tune"] = FineTuneConfig(**d["fine_tune"]) if d.get("fine_tune") else None
        kw["scst"] = ScstConfig(**d.get("scst", {}))
        kw.setdefault("equivariance", 0.0)  # saved before the term existed: resume as trained
        return cls(**kw)


@dataclass
class Progress:
    """Where training is; part of every checkpoint."""
    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    best: float = -math.inf
    best_step: int = 0
    stale: int = 0                       # validations since the last improvement
    baseline: float = 0.0                # REINFORCE moving-average baseline (hard attention)
    skipped_steps: int = 0               # steps not applied: a non-finite loss or gradient (issue 15)
    skipped_captions: int = 0            # captions left out, features not finite (rank 0's share)


class Objective(nn.Module):
    """The training loss as a module, so that DistributedDataParallel wraps one forward."""

    def __init__(self, decoder: AttentionDecoder, cfg: TrainConfig, encoder: nn.Module | None = None):
        super().__init__()
        self.decoder, self.cfg = decoder, cfg
        self.encoder = encoder  # fine-tuned encoder layers (finetune.TunedEncoder), None on cached features

    def forward(self, batch, words, baseline: float, generator=None):
        features, captions, lengths = batch.features, batch.captions, batch.lengths
        if self.encoder is not None:
            features = self.encoder(features, batch.image_index)  # encoder inputs, one per image → (B, L, D)
        if self.decoder.config.attention == "hard":
            return hard_attention_loss(self.decoder, features, captions, lengths, baseline=baseline,
                                       cfg=self.cfg.hard, alpha_c=self.cfg.alpha_c, generator=generator, words=words,
                                       rotated=batch.rotated, equivariance=self.cfg.equivariance)
        if batch.rotated is not None:                             # `fit` reads them only for the term
            return self.equivariant_loss(features, batch.rotated, captions, lengths, words)
        nll, penalty = sequence_loss(self.decoder, features, captions, lengths, self.cfg.alpha_c, words=words)
        return nll + penalty, {"nll": nll.detach(), "penalty": penalty.detach()}

    def equivariant_loss(self, features, rotated, captions, lengths, words):
        """The soft loss plus λ × the half-turn equivariance of the maps, per word (equivariance.py)."""
        nll, penalty, u, mask = sequence_terms(self.decoder, features, captions, lengths, self.cfg.alpha_c, words)
        words = mask.sum() if words is None else words
        equi = equivariance_term(self.decoder, u.alphas, rotated, captions, mask, words)
        return nll + penalty + self.cfg.equivariance * equi, {
            "nll": nll.detach(), "penalty": penalty.detach(), "equivariance": equi.detach()}


def train_step(objective, batch, optimizer, scaler, cfg: TrainConfig, progress: Progress,
               generator: torch.Generator, d: distributed.Dist, device: torch.device) -> dict:
    """One optimisation step on this process's share of a global batch; returns the loss terms.

    A step whose loss terms or gradient norm are not finite (on any process) is not applied:
    the weights stay as they were, and the returned terms show the non-finite value.
    """
    objective.train()
    # Normalise by the global count (XE: predicted words; SCST: images) so N processes give the
    # gradient of one big batch.
    units = float(len(batch.rows)) if cfg.objective == "scst" else float((batch.lengths - 1).sum())
    words = distributed.all_sum(d, [units], device)[0] / d.world
    amp = AMP_DTYPES[cfg.amp]
    autocast = torch.autocast(device.type, dtype=amp) if amp else contextlib.nullcontext()
    with autocast:
        loss, terms = objective(batch, words, progress.baseline, generator)
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(objective.parameters(), cfg.grad_clip)
    terms = {"loss": float(loss.detach()), **{k: float(v) for k, v in terms.items()},
             "grad_norm": float(grad_norm)}
    counts = {k: terms.pop(k) for k in ("reward_sum", "sampled") if k in terms}
    # Each process's terms are its share of the global batch's: their mean is the batch's.
    names = list(terms) + list(counts)
    totals = distributed.all_sum(d, [terms[k] for k in terms] + list(counts.values()), device)
    terms = {k: v / d.world for k, v in zip(names[:len(terms)], totals)}
    # faults (issue 15): the sums carry a NaN or inf from any process, so all agree to skip the update.
    applied = faults.all_finite(terms)
    if applied:
        scaler.step(optimizer)
    scaler.update()
    if counts and applied:
        reward_sum, sampled = totals[len(terms):]
        progress.baseline = update_baseline(progress.baseline, reward_sum, sampled, cfg.hard.baseline_decay)
        terms["baseline"] = progress.baseline
    return terms


def validate(model, data: CaptionData, cfg: TrainConfig, device, d: distributed.Dist, features=None) -> dict:
    """Generation-based validation, split over processes and scored on the gathered captions.

    Args:
        features: rows → (n, L, D) features when they are not the cached ones (fine-tuning).
    """
    t0 = time.monotonic()
    texts, hyps = caption_split(model, data, data.vocab, "val", beam_size=cfg.val_beam_size, max_len=data.max_len,
                                device=device, max_images=cfg.val_images, shard=(d.rank, d.world), features=features)
    texts = distributed.gather_dicts(d, texts)
    maps = distributed.gather_dicts(d, {i: h.attention.astype("float16") for i, h in hyps.items()})
    metrics = None
    if d.main:
        metrics = score_validation(texts, data.references["val"])
        metrics["attention_health"] = attention_health(maps.values())
    metrics = distributed.broadcast(d, metrics)
    return {**metrics, "seconds": round(time.monotonic() - t0, 2)}


def _checkpoint(model, optimizer, scheduler, progress, cfg, model_cfg, data, generator, metrics) -> dict:
    return {"model": model.state_dict(), "decoder": model_cfg.to_dict(), "train": cfg.to_dict(),
            "vocab": data.vocab.words, "encoder": data.encoder.to_dict(), "max_len": data.max_len,
            "step": progress.step, "progress": asdict(progress), "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(), "metrics": metrics,
            "rng": {"torch": torch.get_rng_state(), "generator": generator.get_state(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
            "data": {"dir": os.path.abspath(data.dir), "fingerprint": data.encoder.fingerprint}}


def _resume_config(ck: dict, data: CaptionData, cfg: TrainConfig, path: str) -> tuple[DecoderConfig, TrainConfig]:
    if ck["data"]["fingerprint"] != data.encoder.fingerprint or ck["vocab"] != data.vocab.words:
        raise CaptionerError(f"--resume: {path} was trained on other data than {data.dir}")
    saved = TrainConfig.from_dict(ck["train"])
    if cfg.objective == "scst" and saved.objective != "scst":
        raise CaptionerError(f"--resume --objective scst: {path} is a cross-entropy run; start self-critical "
                             f"training from it with --init {os.path.join(os.path.dirname(path), 'best.pt')} "
                             "and a new --out")
    # --- encoder fine-tuning: the layers and their learning rate are the saved ones; workers may change
    if cfg.fine_tune is not None and (saved.fine_tune is None or (cfg.fine_tune.start, cfg.fine_tune.lr)
                                      != (saved.fine_tune.start, saved.fine_tune.lr)):
        raise CaptionerError(f"--resume: {path} was trained {'with other' if saved.fine_tune else 'without'} "
                             "--fine-tune-encoder settings; resume without those flags to continue as it was")
    if saved.fine_tune is not None and "encoder_state" not in ck:
        raise CaptionerError(f"--resume: {path} lacks the encoder_state its fine-tuning settings call for")
    fine_tune = saved.to_dict()["fine_tune"]
    if fine_tune and cfg.fine_tune is not None:
        fine_tune["workers"] = cfg.fine_tune.workers
    # What may change on resume: how long to go on, and how often to save.
    return DecoderConfig(**ck["decoder"]), TrainConfig.from_dict(
        {**saved.to_dict(), "epochs": cfg.epochs, "max_minutes": cfg.max_minutes,
         "checkpoint_every": cfg.checkpoint_every, "checkpoint_minutes": cfg.checkpoint_minutes,
         "fine_tune": fine_tune})


def _init_checkpoint(path: str, data: CaptionData, dev) -> dict:
    """The checkpoint of --init, refused unless it was trained on this vocabulary and encoder."""
    try:
        ck = load_checkpoint(path, map_location=dev)
    except CaptionerError as e:
        raise CaptionerError(f"--init: {e}") from None
    if ck["vocab"] != data.vocab.words:
        raise CaptionerError(f"--init: {path} has a vocabulary of {len(ck['vocab'])} words that differs from "
                             f"{data.dir}'s ({len(data.vocab)} words); start from a model trained on this data")
    fingerprint = ck.get("data", {}).get("fingerprint") or EncoderSpec.from_dict(ck["encoder"]).fingerprint
    if fingerprint != data.encoder.fingerprint:
        raise CaptionerError(f"--init: {path} was trained on features of encoder {fingerprint}, but {data.dir} "
                             f"holds features of encoder {data.encoder.fingerprint}")
    return ck


def fit(data_dir: str, out_dir: str, model_cfg: DecoderConfig | None = None,
        cfg: TrainConfig = TrainConfig(), *, resume: bool = False, device: str = "auto",
        progress_bar: bool = True, stop: faults.GracefulStop | None = None) -> Progress:
    """Train a decoder on a prepared data directory, writing last.pt, best.pt and metrics.jsonl.

    Args:
        data_dir: made by `prepare`.
        out_dir: the run directory.
        model_cfg: decoder sizes (vocab_size is taken from the data); ignored on resume.
        cfg: optimisation settings; on resume the saved ones are used, except epochs,
            max_minutes and checkpoint_every. With cfg.init, training starts from that
            checkpoint's weights and decoder config (a fresh optimizer); cfg.objective "scst"
            needs cfg.init or a resume.
        resume: continue from out_dir/last.pt (cfg.init is then ignored).
        device: "auto", "cpu" or "cuda" (under torchrun each process takes its local GPU).
        stop: once it is requested (SIGTERM, SIGINT), every process finishes its step, rank 0
            saves last.pt, and fit returns; `resume` continues from there exactly.

    Raises:
        CaptionerError: the final save of last.pt or best.pt failed (e.g. a full disk); the
            message names the last good checkpoint. Failed saves before it only warn.
    """
    start = time.monotonic()
    d, dev = distributed.setup(device)
    data = CaptionData(data_dir)
    last_path, best_path = os.path.join(out_dir, "last.pt"), os.path.join(out_dir, "best.pt")
    ck = None
    if resume:
        if not os.path.exists(last_path):
            raise CaptionerError(f"--resume: {last_path} does not exist; nothing to resume")
        ck = load_checkpoint(last_path, map_location=dev)
        model_cfg, cfg = _resume_config(ck, data, cfg, last_path)
    init = None
    if ck is None and cfg.init:
        init = _init_checkpoint(cfg.init, data, dev)
        model_cfg = DecoderConfig(**init["decoder"])
    elif ck is None and cfg.objective == "scst":
        raise CaptionerError("--objective scst starts from a trained model: pass --init RUN/best.pt "
                             "(or --resume to continue a self-critical run)")
    model_cfg = DecoderConfig(**{**(model_cfg or DecoderConfig(0)).to_dict(), "vocab_size": len(data.vocab)})
    # The equivariance term: cross-entropy (soft, or hard's expected-context captions) on cached
    # features. Without it the turned features are not read at all (no extra I/O per batch).
    equivariant = cfg.equivariance > 0 and cfg.objective == "xe" and cfg.fine_tune is None
    if not equivariant:
        data.rotated = None
    elif d.main and data.rotated is None:
        print(f"note: {data_dir} has no features of the images turned 180° (prepared with --no-rotated or by "
              "an older version), so attention trains without its equivariance term and its heatmaps "
              "may sit beside the objects they name; run prepare again into a new directory to add them",
              file=sys.stderr)
    torch.manual_seed(cfg.seed)
    model = AttentionDecoder.from_config(model_cfg)
    model.set_feature_stats(*data.feature_stats())
    model = model.to(dev)
    optimizer = make_optimizer(model, cfg.lr)
    # --- encoder fine-tuning (finetune.py) ---
    tuning, setup = None, {}
    if cfg.fine_tune is not None:
        t0 = time.monotonic()
        tuning = FineTuning(data, cfg.fine_tune, d, dev, progress=progress_bar and d.main)
        if ck is not None:
            tuning.encoder.load_encoder_state(ck["encoder_state"], last_path)
        optimizer.add_param_group({"params": list(tuning.parameters()), "lr": cfg.fine_tune.lr})
        # The one-off pool4 cache is preparation, like prepare's features: not training time.
        setup = {"fine_tune_setup_seconds": round(time.monotonic() - t0, 2)}
        start += time.monotonic() - t0
    # --- end of encoder fine-tuning ---
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", factor=0.5, patience=2)
    scaler = torch.amp.GradScaler(dev.type, enabled=cfg.amp == "fp16" and dev.type == "cuda")
    # Hard attention's draws: a stream per process, saved with the checkpoint.
    generator = torch.Generator(device=dev).manual_seed(cfg.seed + 1 + d.rank)
    progress = Progress()
    if init is not None:
        model.load_state_dict(init["model"])
    if ck is not None:
        model.load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        progress = Progress(**ck["progress"])
        torch.set_rng_state(ck["rng"]["torch"].cpu())
        generator.set_state(ck["rng"]["generator"].cpu())
        if ck["rng"]["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([s.cpu() for s in ck["rng"]["cuda"]])
    objective: nn.Module = Objective(model, cfg, tuning.encoder if tuning else None)
    source = tuning or data  # batches of cached features, or of the fine-tuned encoder's inputs
    if cfg.objective == "scst":
        if tuning:
            raise CaptionerError("--objective scst does not fine-tune the encoder; leave out --fine-tune-encoder")
        objective = SelfCritical(model, cfg.scst, training_scorer(data, cfg.scst.end_token), data.max_len)
        source = TrainingImages(data)
    if d.active:
        objective = DistributedDataParallel(objective, device_ids=[dev.index] if dev.type == "cuda" else None)
    if cfg.compile:
        model.compile_step()
    log = None
    if d.main:
        os.makedirs(out_dir, exist_ok=True)
        log = open(os.path.join(out_dir, "metrics.jsonl"), "a", encoding="utf-8")

    def write_log(record: dict) -> None:
        if log:
            try:  # faults (issue 15): a full disk loses log lines, not the run
                log.write(json.dumps({**record, "time": round(time.monotonic() - start, 2)}) + "\n")
                log.flush()
            except OSError:
                pass

    last_save = time.monotonic()
    # faults (issue 15): a failed save names the last good checkpoint; training goes on and retries
    # at the next save, and a failed final save ends fit with that message (exit status 2).
    notes = faults.FaultLog(write_log, show=d.main, print_line=lambda line: tqdm.write(line, file=sys.stderr))
    saver = faults.CheckpointSaver(good={last_path: progress.step} if ck is not None else {})
    if ck is not None and os.path.exists(best_path):
        saver.good[best_path] = progress.best_step
    # --- familiarity (captioner.familiarity): training features' statistics, for "unlike the training images"
    # A resumed run keeps the statistics it saved (same data and seed), without rebuilding the encoder.
    # A fine-tuned encoder's features are not the cache's: its checkpoints get theirs when fit ends.
    familiarity = ck.get("familiarity") if ck is not None and tuning is None else None
    if familiarity is None and d.main and tuning is None:
        stats = familiarity_stats(data, seed=cfg.seed)
        familiarity = stats.to_dict() if stats is not None else None
    # --- end familiarity

    def save(path: str, metrics: dict, final: bool = False) -> None:
        nonlocal last_save
        if d.main:
            state = _checkpoint(model, optimizer, scheduler, progress, cfg, model_cfg, data, generator, metrics)
            state["familiarity"] = familiarity
            if tuning:
                state["encoder_state"] = tuning.encoder.encoder_state()  # the trained layers, trunk names
            if not saver.save(state, path):
                then = "fit ends with this error" if final else "training goes on and retries at the next save"
                notes.warn("save_failed", f"{saver.failed[path]}; {then}", step=progress.step, show=not final)
        if path == last_path:
            last_save = time.monotonic()

    budget = cfg.max_minutes * 60 if cfg.max_minutes else math.inf
    n_batches = source.num_batches(cfg.batch_size, world=d.world)
    metrics: dict = ck["metrics"] if ck is not None else {}
    write_log({"event": "start", "step": progress.step, "epoch": progress.epoch, "resume": resume,
               "decoder": model_cfg.to_dict(), "train": cfg.to_dict(), "device": str(dev), "world": d.world,
               "train_captions": int(len(data.lengths)), "batches_per_epoch": n_batches, **setup})
    pin = dev.type == "cuda"
    out_of_time = stopped = False
    while progress.epoch < cfg.epochs and not out_of_time and not stopped:
        bar = tqdm(total=n_batches, initial=progress.batch_in_epoch, desc=f"epoch {progress.epoch + 1}",
                   disable=not (progress_bar and d.main), dynamic_ncols=True, leave=False)
        for batch in source.batches(cfg.batch_size, seed=cfg.seed, epoch=progress.epoch,
                                  start=progress.batch_in_epoch, rank=d.rank, world=d.world, pin=pin):
            # faults (issue 15): captions of damaged feature rows were left out; a non-finite step is not applied.
            if batch.dropped:
                progress.skipped_captions += len(batch.dropped)
                notes.damaged_rows(batch.dropped, data, progress.step)
            terms = train_step(objective, batch.to(dev, non_blocking=pin), optimizer, scaler, cfg, progress,
                               generator, d, dev)
            if not faults.all_finite(terms):
                progress.skipped_steps += 1
                notes.skipped_step(progress.step + 1, terms, scaled=scaler.is_enabled())
            progress.step += 1
            progress.batch_in_epoch += 1
            bar.update(1)
            bar.set_postfix(loss=f"{terms['loss']:.3f}")
            if progress.step % cfg.log_every == 0:
                write_log({"event": "train", "step": progress.step, "epoch": progress.epoch,
                           "lr": optimizer.param_groups[0]["lr"], **terms})
            due = cfg.checkpoint_minutes and time.monotonic() - last_save > cfg.checkpoint_minutes * 60
            if due or (cfg.checkpoint_every and progress.step % cfg.checkpoint_every == 0):
                save(last_path, metrics)   # rank 0 alone writes, so ranks need not agree on when
            # faults (issue 15): SIGTERM/SIGINT on any process stops all of them after this step.
            if distributed.any_true(d, faults.stop_requested(stop), dev):
                stopped = True
                break
            if distributed.any_true(d, time.monotonic() - start > budget, dev):
                out_of_time = True
                break
        bar.close()
        if stopped:
            break
        if not out_of_time:
            progress.epoch += 1
            progress.batch_in_epoch = 0
        metrics = validate(model, data, cfg, dev, d, tuning.features if tuning else None)
        score = metrics[cfg.metric]
        improved = score > progress.best
        if improved:
            progress.best, progress.best_step, progress.stale = score, progress.step, 0
        else:
            progress.stale += 1
        scheduler.step(score)
        write_log({"event": "val", "step": progress.step, "epoch": progress.epoch, **metrics,
                   "lr": optimizer.param_groups[0]["lr"], "best": progress.best})
        if progress_bar and d.main:
            tqdm.write(f"epoch {progress.epoch}: step {progress.step}, BLEU-4 {metrics['BLEU-4']:.3f}, "
                       f"CIDEr {metrics['CIDEr']:.3f}{' (best)' if improved else ''}; "
                       f"e.g. {metrics['example']!r}; {health_summary(metrics['attention_health'])}")
        found = problems(metrics["attention_health"])
        if found and d.main:
            tqdm.write(f"warning: step {progress.step}: {'; '.join(found)}: {ADVICE}", file=sys.stderr)
        # A signal during validation: last.pt is saved next, so stop there.
        stopped = distributed.any_true(d, faults.stop_requested(stop), dev)
        final = stopped or out_of_time or progress.epoch >= cfg.epochs or progress.stale >= cfg.patience
        if improved:
            save(best_path, metrics, final)
        save(last_path, metrics, final)
        if progress.stale >= cfg.patience:
            write_log({"event": "early_stop", "step": progress.step, "epoch": progress.epoch})
            break
    # faults (issue 15): a stop saves last.pt (unless it was just saved) and leaves best.pt as it is.
    if stopped:
        if saver.good.get(last_path) != progress.step:
            save(last_path, metrics, final=True)
        write_log({"event": "stopped", "signal": stop.signal_name, "step": progress.step, "epoch": progress.epoch,
                   "saved": last_path not in saver.failed})
    elif d.main and not os.path.exists(best_path):  # e.g. resumed after the run had finished
        save(best_path, metrics, final=True)
    if tuning is not None and d.main and not stopped:
        seconds = add_tuned_familiarity([best_path, last_path], data, saver, dev, seed=cfg.seed,
                                        workers=cfg.fine_tune.workers)
        write_log({"event": "familiarity", "step": progress.step, "seconds": round(seconds, 2)})
    write_log({"event": "end", "step": progress.step, "epoch": progress.epoch, "best": progress.best,
               "skipped_steps": progress.skipped_steps, "skipped_captions": progress.skipped_captions})
    if log:
        log.close()
    # Every rank waits for rank 0's saves and ends the same way: a failed final save is an error.
    failed, resumable = distributed.broadcast(d, (saver.failed, last_path in saver.good))
    if failed:
        message = failed.get(last_path) or next(iter(failed.values()))
        raise CaptionerError(message + ("; `fit --resume` continues from it" if resumable else ""))
    return progress
