"""Loss terms as parts: what a term is, what it reads, and the attention terms' settings.

A term that keeps state across steps (REINFORCE's baseline) claims it from the run's `TermState`, which checkpoints
save, and updates it in place (`after_step`).
Symbols: B captions, L locations, D feature size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, NamedTuple

import torch

from captioner.options import check_positive


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
    hard: Any  # objectives.reinforce.HardAttentionConfig
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
