"""One optimisation step: the objective as a module, and the step that applies it.

Shapes: B captions (images for SCST), L locations, D feature size, T steps.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from captioner.models.decoder import AttentionDecoder
from captioner.models.views import max_shift, random_shifts
from captioner.objectives.consistency import consistency
from captioner.objectives.correctness import attention_correctness
from captioner.objectives.cross_entropy import sequence_terms
from captioner.objectives.reinforce import hard_attention_loss, update_baseline
from captioner.train import distributed, resilience
from captioner.train.config import Progress, TrainConfig

AMP_DTYPES = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def make_optimizer(model: torch.nn.Module, lr: float) -> torch.optim.Adam:
    """Adam, fused into one kernel per step (CPU and CUDA): on CPU the unfused update of the
    decoder's 15M parameters took 100 ms of a 500 ms step, the fused one 6 ms."""
    return torch.optim.Adam(model.parameters(), lr=lr, fused=True)


class Objective(nn.Module):
    """The training loss as a module, so that DistributedDataParallel wraps one forward."""

    def __init__(self, decoder: AttentionDecoder, cfg: TrainConfig, encoder: nn.Module | None = None, targets=None):
        super().__init__()
        self.decoder, self.cfg = decoder, cfg
        self.encoder = encoder  # fine-tuned encoder layers (finetune.TunedEncoder), None on cached features
        self.targets = targets  # `fit --boxes`: data.boxes.BoxTargets

    def forward(self, batch, words, baseline: float, generator=None):
        features, captions, lengths, cfg = batch.features, batch.captions, batch.lengths, self.cfg
        turned, rows, moves = batch.turned, batch.turned_rows, batch.turned_moves
        if self.encoder is not None:  # encoder inputs, one per image → (B, L, D)
            if cfg.consistency > 0:
                turned, rows, moves = self.views(batch, generator)
            features = self.encoder(features, batch.image_index)
        if self.decoder.config.attention == "hard":
            loss, terms, u, mask = hard_attention_loss(
                self.decoder,
                features,
                captions,
                lengths,
                baseline=baseline,
                cfg=cfg.hard,
                alpha_c=cfg.alpha_c,
                generator=generator,
                words=words,
            )
            predicted = None
        else:
            choice = batch.box_images is not None and cfg.boxes_choice_weight > 0
            nll, penalty, u, mask, predicted = sequence_terms(
                self.decoder, features, captions, lengths, cfg.alpha_c, words, predict=choice
            )
            loss, terms = nll + penalty, {"nll": nll.detach(), "penalty": penalty.detach()}
        words = mask.sum() if words is None else words
        if turned is not None and cfg.consistency > 0:  # `fit` reads the views' features only for the term
            c = consistency(self.decoder, features, turned, rows, moves, u, mask, words, generator)
            loss = loss + cfg.consistency * c
            terms["consistency"] = c.detach()
        if batch.box_rows is not None and cfg.boxes_weight > 0:
            b = attention_correctness(u.alphas, batch.box_rows, batch.box_steps, batch.box_masks, words)
            loss = loss + cfg.boxes_weight * b
            terms["boxes"] = b.detach()
        if predicted is not None:  # soft attention, --boxes-choice-weight
            b = self.chosen_word_correctness(batch.box_images, predicted, mask, u.alphas, words)
            loss = loss + cfg.boxes_choice_weight * b
            terms["boxes_choice"] = b.detach()
        return loss, terms

    def chosen_word_correctness(self, images, predicted, mask, alphas, words) -> torch.Tensor:
        """Attention correctness at the word the model would write at each step (objectives.correctness)."""
        found = self.targets.for_predictions(images.cpu().numpy(), predicted.cpu().numpy(), mask.cpu().numpy())
        if found is None:
            return alphas.sum() * 0.0
        rows, steps, masks = (torch.from_numpy(x).to(alphas.device) for x in found)
        return attention_correctness(alphas, rows, steps, masks, words)

    @torch.no_grad()
    def views(self, batch, generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A fine-tuned encoder's features of the views of a share of the captions' images, those
        captions' places, and the views' moves; without gradients: the views teach the attention."""
        B = len(batch.captions)
        rows = torch.randperm(B, generator=generator, device=batch.captions.device)
        rows = rows[: max(1, math.ceil(self.cfg.consistency_share * B))].sort().values
        images, index = batch.image_index[rows].unique(return_inverse=True)
        grid = self.encoder.grid(batch.features)
        moves = random_shifts(len(images), max_shift(grid), generator, batch.captions.device)
        return self.encoder(batch.features[images], moves=moves)[index], rows, moves[index]


def train_step(
    objective,
    batch,
    optimizer,
    scaler,
    cfg: TrainConfig,
    progress: Progress,
    generator: torch.Generator,
    d: distributed.Dist,
    device: torch.device,
) -> dict:
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
    terms = {"loss": float(loss.detach()), **{k: float(v) for k, v in terms.items()}, "grad_norm": float(grad_norm)}
    counts = {k: terms.pop(k) for k in ("reward_sum", "sampled") if k in terms}
    # Each process's terms are its share of the global batch's: their mean is the batch's.
    names = list(terms) + list(counts)
    totals = distributed.all_sum(d, [terms[k] for k in terms] + list(counts.values()), device)
    terms = {k: v / d.world for k, v in zip(names[: len(terms)], totals)}
    # faults: the sums carry a NaN or inf from any process, so all agree to skip the update.
    applied = resilience.all_finite(terms)
    if applied:
        scaler.step(optimizer)
    scaler.update()
    if counts and applied:
        reward_sum, sampled = totals[len(terms) :]
        progress.baseline = update_baseline(progress.baseline, reward_sum, sampled, cfg.hard.baseline_decay)
        terms["baseline"] = progress.baseline
    return terms
