"""Attention correctness (Liu et al., "Attention Correctness in Neural Image Captioning", AAAI 2017):
where a dataset has object boxes, a word that names a boxed object should look at it.

For each such word, −log Σ_{i in the object's cells} α_ti: the attention on the object, as a likelihood. A batch carries
the cells as a (B, T-1, L) mask, empty where a step's word names no boxed object.

Why the model's own words too: captions name a scene's objects in either order, so under teacher forcing the map drawn
before "yellow" in "a yellow triangle and a purple square" pays least split between the two objects. At the word the
model itself would write, the map must lie on the object of its own choice. Symbols: B captions, T steps, L locations.
"""

from __future__ import annotations

import torch

from captioner.objectives.terms import Context, Setup, Term, TermsConfig, wide

LOG_EPS = 1e-12


def attention_correctness(alphas: torch.Tensor, masks: torch.Tensor, words) -> torch.Tensor:
    """λ's multiplicand per word: Σ over the steps with a target of −log (attention on the object's cells);
    `alphas` and `masks` are (B, T-1, L)."""
    on_object = (wide(alphas) * masks).sum(-1)  # (B, T-1)
    return -(on_object.clamp_min(LOG_EPS).log() * masks.any(-1)).sum() / words


class AttentionCorrectness(Term):
    """`attention_correctness` on the dataset's words (`--boxes`); its weight is `--boxes-weight`."""

    name = "boxes"

    @classmethod
    def make(cls, cfg: TermsConfig, setup: Setup) -> Term | None:
        return cls(cfg.boxes_weight) if setup.targets is not None and cfg.boxes_weight > 0 else None

    def __call__(self, ctx: Context) -> torch.Tensor:
        return attention_correctness(ctx.passed.unrolled.alphas, ctx.batch.boxes.masks, ctx.words)


class ChosenWordCorrectness(Term):
    """`attention_correctness` at the word the model would write at each step, where it names an object of
    the image (`--boxes-choice-weight`). The words are looked up on the host, so the step does not compile it."""

    name = "boxes_choice"
    capturable = False
    predicts = True

    def __init__(self, weight: float, targets):
        super().__init__(weight)
        self.targets = targets

    @classmethod
    def make(cls, cfg: TermsConfig, setup: Setup) -> Term | None:
        on = setup.targets is not None and cfg.boxes_choice_weight > 0
        return cls(cfg.boxes_choice_weight, setup.targets) if on else None

    def __call__(self, ctx: Context) -> torch.Tensor:
        p = ctx.passed
        alphas = p.unrolled.alphas
        # The lookup needs the words on the host: an explicit copy, and a host synchronisation.
        masks = self.targets.masks_for_predictions(
            ctx.batch.boxes.images.cpu().numpy(), p.predicted.cpu().numpy(), p.mask.cpu().numpy()
        )
        return attention_correctness(alphas, torch.from_numpy(masks).to(alphas.device), ctx.words)
