"""Loss terms as parts: what a term is, what it reads, and our attention terms with their settings.

A term that keeps state across steps (REINFORCE's baseline) claims it from the run's `TermState`, which checkpoints
save, and updates it in place (`after_step`). The paper's terms are in `objectives.objective`; ours, beside the paper:

- **View consistency**, learnt without boxes: each map is asked to be found again in a view of the image
  (`models.views`: turned 180° and moved by one or two whole cells) and to be sharp: C_t = −log Σ_i α_ti (V⁻¹α'_t)_i,
  α_t the map on the image, α'_t the map the same state h_{t−1} gives on the view, V⁻¹ bringing a map on the view back
  onto the image's cells. Only sharp maps that follow the content make it small; h_{t−1} is detached, so the term
  trains where to look, not the LSTM's state. Why: docs/attention.md#view-consistency.
- **Attention correctness** (Liu et al., AAAI 2017), where a dataset has object boxes: for each word that names a
  boxed object, −log Σ_{i in the object's cells} α_ti. A batch carries the cells as a (B, T-1, L) mask, empty where a
  step's word names no boxed object. Captions name a scene's objects in either order, so under teacher forcing the
  map before "yellow" in "a yellow triangle and a purple square" pays least split between the two objects; at the word
  the model itself would write, the map must lie on the object of its own choice (`--boxes-choice-weight`).

Symbols: B captions, T steps, L locations, D feature size, H LSTM size, E embedding size, N picked (caption, step)
pairs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any, NamedTuple

import torch

from captioner.models.decoder import AttentionDecoder, Unrolled
from captioner.models.views import back_from_view
from captioner.options import check_positive

LOG_EPS = 1e-12  # floor under α before the log: a sampled location always has α > 0, but float32 may round


@dataclass(frozen=True)
class TermsConfig:
    """Attention terms: the doubly stochastic regularisation, the view consistency and attention correctness."""

    alpha_c: Annotated[float | None, "λ of the doubly stochastic regularisation, eq. (14)"] = None
    consistency: Annotated[
        float | None,
        "weight of the attention maps' consistency between each image and its view, turned 180° and moved "
        "(sharp maps that follow the content); needs the views' features prepare writes by default",
    ] = None
    consistency_share: Annotated[float, "share of each batch's captions the consistency is estimated on"] = 0.25
    boxes_weight: Annotated[
        float,
        "weight of the attention correctness term of `fit --boxes`: caption words that name a boxed object "
        "also teach attention where it is",
    ] = 10.0
    boxes_choice_weight: Annotated[
        float,
        "weight of the same term at the word the model itself would write at each step (its most likely word), "
        "where that word names an object of the image (--boxes, soft attention; 0: off)",
    ] = 0.0
    word_maps: Annotated[
        bool,
        "teach attention where each word lies without boxes: word detectors fitted on the captions when fit starts "
        "mark the 3×3 cells around each trusted word's peak, borrowed by an untrusted word next to it in a caption, "
        "which attention correctness teaches as --boxes does (--boxes-weight)",
    ] = False
    paper: Annotated[
        bool,
        "--paper-objective",
        "train on the paper's objective exactly: eq. (14) with λ = 1 and no attention term of ours "
        "(--alpha-c 1, --consistency 0; refused beside other values of those)",
    ] = False

    def __post_init__(self):
        check_positive(self, "consistency_share")


def wide(t: torch.Tensor) -> torch.Tensor:
    """t in float32 at least: losses are summed in float32 under autocast, in float64 where the model is."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


class Setup(NamedTuple):
    """What a run's terms are made from, besides the attention terms' settings (`TermsConfig`)."""

    attention: str  # "soft" or "hard"
    hard: Any  # objectives.objective.HardAttentionConfig
    views: bool  # the batches carry the views' features (or a fine-tuned encoder makes them)
    state: TermState  # the run's terms' state, which terms with state claim theirs from
    targets: Any  # data.boxes.BoxTargets of `fit --boxes`, or None


class Context(NamedTuple):
    """What a term reads for one batch."""

    decoder: Any  # models.decoder.AttentionDecoder
    batch: Any  # data.batches.Batch (or ImageBatch for self-critical training)
    features: torch.Tensor  # (B, L, D) the raw features the decoder saw, one row per caption
    passed: Any  # objectives.objective.TeacherForced, or None when the objective makes no pass
    words: torch.Tensor | float  # what a batch total is divided by (its real steps; under DDP the global mean)
    generator: torch.Generator | None  # the terms' random draws


class Term:
    """A loss term: `weight` × `self(ctx)` is its share of the loss (a negative weight: a bonus).

    `capturable`: a compiled step can hold it (no host synchronisation, fixed shapes); `predicts`: it reads
    the pass's most likely word at each step; `teacher_forced`: it reads the teacher-forced pass."""

    name = ""
    capturable = True
    predicts = False
    teacher_forced = True

    def __init__(self, weight: float = 1.0):
        self.weight = weight

    @classmethod
    def make(cls, cfg: TermsConfig, setup: Setup) -> Term | None:
        """The term a run with these settings trains with, or None when it trains without it."""
        return cls()

    def __call__(self, ctx: Context) -> torch.Tensor:
        raise NotImplementedError

    def before_pass(self, decoder, batch) -> None:
        """Work on `batch` that needs no gradient, done before the pass: under DDP, outside its forward."""

    def after_step(self, applied: torch.Tensor) -> None:
        """Update the term's own state once the step is done; `applied` (a bool tensor) says whether the
        optimizer applied it (a non-finite step is not)."""

    def shared(self) -> list[torch.Tensor]:
        """The last call's tensors that `after_step` reads, summed over processes under DDP first."""
        return []

    def report(self) -> dict[str, torch.Tensor]:
        """Other figures of the last call, logged beside the value (detached)."""
        return {}


class TermState:
    """The terms' own state across steps: for each term by name, named tensors on the training device.

    The same tensors serve every objective of a run; `saved` is a checkpoint's `state_dict()`, or None for
    a fresh run."""

    def __init__(self, device: torch.device | str, saved: dict | None = None):
        self.device = torch.device(device)
        self.tensors = {name: {k: v.to(self.device) for k, v in d.items()} for name, d in (saved or {}).items()}

    def claim(self, term: str, **fresh: torch.Tensor) -> dict[str, torch.Tensor]:
        """`term`'s state: what was saved of it, else `fresh` (moved to the device)."""
        state = self.tensors.setdefault(term, {})
        for k, v in fresh.items():
            state.setdefault(k, v.to(self.device))
        return state

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        return {name: {k: v.detach().clone() for k, v in d.items()} for name, d in self.tensors.items()}


AGREEMENT_FLOOR = 1e-6  # under the agreement before the log: maps that share no cell cost log 1e6, not inf


def disagreement(maps: torch.Tensor, maps_in_view: torch.Tensor, moves: torch.Tensor, grid: int) -> torch.Tensor:
    """−log Σ_i α_i (V⁻¹α')_i per pair (N,): −log of the chance that a cell drawn from each map is the same cell of the
    image. Mass on cells only one of the two shows agrees with nothing: it pays like mass on the wrong cell."""
    back = back_from_view(wide(maps_in_view), moves, grid)
    return -((wide(maps) * back).sum(-1) + AGREEMENT_FLOOR).log()


def real_steps(mask: torch.Tensor, rows: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One random real step (N,) of each caption in `rows`, from the (B, T-1) mask."""
    noise = torch.rand(mask[rows].shape, generator=generator, device=mask.device)
    return noise.masked_fill(~mask[rows], -1.0).argmax(1)


def consistency(
    decoder: AttentionDecoder,
    features: torch.Tensor,
    views: torch.Tensor,
    rows: torch.Tensor,
    moves: torch.Tensor,
    unrolled: Unrolled,
    mask: torch.Tensor,
    words,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """λ's multiplicand per word: the consistency between the maps on `features` (B, L, D) and on `views`
    (N, L, D), the views of captions `rows` (N,) moved by `moves` (N, 2) cells, estimated at one random real
    step of each of those captions and scaled to the batch's real steps (`mask`, (B, T-1))."""
    steps = real_steps(mask, rows, generator)  # (N,)
    images = decoder.normalize(features[rows])  # (N, L, D)
    h0, _ = decoder.init_state(images)  # (N, H)
    h_before = unrolled.h[rows, (steps - 1).clamp_min(0)]  # (N, H) h_{t-1}
    h_before = torch.where((steps == 0).unsqueeze(1), h0, h_before).detach()
    word_before = unrolled.emb[rows, steps].detach()  # (N, E) E y_{t-1}
    maps = decoder.attend(decoder.attention.project(images), h_before, word_before)  # (N, L) α
    maps_in_view = decoder.attend(decoder.attention.project(decoder.normalize(views)), h_before, word_before)  # α'
    grid = math.isqrt(maps.size(-1))
    per_step = disagreement(maps, maps_in_view, moves, grid)  # (N,)
    real = mask[rows].any(1)  # (N,) False for a padding row of a fixed-shape batch
    return (per_step * real).sum() / real.sum().clamp_min(1) * mask.sum() / words


class ViewConsistency(Term):
    """The consistency of the maps between each image and its view (`consistency`), per word; its
    weight is `--consistency`. A batch without views (every picked image damaged) adds nothing."""

    name = "consistency"

    @classmethod
    def make(cls, cfg: TermsConfig, setup: Setup) -> Term | None:
        return cls(cfg.consistency) if setup.views and cfg.consistency > 0 else None

    def __call__(self, ctx: Context) -> torch.Tensor:
        b, p = ctx.batch, ctx.passed
        if b.views is None:
            return ctx.features.new_zeros(())
        return consistency(ctx.decoder, ctx.features, *b.views, p.unrolled, p.mask, ctx.words, ctx.generator)


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
