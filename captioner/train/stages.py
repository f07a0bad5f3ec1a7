"""What each stretch of a training run trains: the objective of the settled configs, with its batch source.

A run has one stage (the decoder alone, on the cached features; SCST on the training images) or,
with `--fine-tune-encoder`, two: from `fine_tune.after` on, the decoder trains with the encoder's
layers on the encoder's inputs. Each stage's batches have the shapes its source makes them in
(`source.shapes`: a fine-tuned encoder's are packed), and its objective takes them from there.
"""

from __future__ import annotations

from typing import NamedTuple

from captioner.data.batches import CaptionBatches, FixedShapes, TrainingImages
from captioner.data.boxes import BoxTargets
from captioner.data.dataset import CaptionData
from captioner.models.decoder import AttentionDecoder
from captioner.objectives.objective import Objective, objective_terms
from captioner.objectives.passes import Shapes
from captioner.objectives.reinforce import HardAttentionConfig
from captioner.objectives.scst import SelfCritical, training_scorer
from captioner.objectives.terms import TermsConfig, TermState
from captioner.train.config import TrainConfig
from captioner.train.finetune import FineTuning


class Stage(NamedTuple):
    """What a stretch of the run trains: its objective, and where its batches come from."""

    objective: Objective
    source: CaptionBatches | FineTuning | TrainingImages


def stage(
    data: CaptionData,
    decoder: AttentionDecoder,
    cfg: TrainConfig,
    *,
    state: TermState,
    targets: BoxTargets | None,
    tuning: FineTuning | None = None,
) -> Stage:
    """The objective of the settled configs and its batch source: on the cached features, or on a
    fine-tuned encoder's inputs (which also makes the views of the consistency's share of captions)."""
    if cfg.objective == "scst":
        scorer, graphs = training_scorer(data, cfg.scst.end_token), cfg.optim.cuda_graphs == "auto"
        terms = [SelfCritical(cfg.scst, scorer, data.max_len, graphs=graphs)]
        return Stage(Objective(decoder, terms), TrainingImages(data, cfg.optim.batch_size))
    # `settle` set the consistency to 0 where neither the prepared views nor an encoder's own will be
    views = cfg.terms.consistency > 0 and (tuning is not None or data.views is not None)
    share = cfg.terms.consistency_share if views else 0.0
    fixed = None
    if tuning is None and cfg.optim.shapes == "fixed":
        fixed = FixedShapes.for_data(cfg.optim.batch_size, int(data.lengths.max()))
    source = tuning
    if tuning is None:
        source = CaptionBatches(data, cfg.optim.batch_size, view_share=share, targets=targets, fixed=fixed)
    objective = cross_entropy_objective(
        decoder,
        cfg.terms,
        cfg.hard,
        shapes=source.shapes,
        views=views,
        state=state,
        targets=targets,
        encoder=tuning.encoder if tuning is not None else None,
        view_share=share,
    )
    return Stage(objective, source)


def cross_entropy_objective(
    decoder: AttentionDecoder,
    terms_cfg: TermsConfig,
    hard: HardAttentionConfig,
    *,
    shapes: Shapes,
    views: bool,
    state: TermState,
    targets: BoxTargets | None = None,
    encoder=None,
    view_share: float = 0.0,
) -> Objective:
    """The cross-entropy objective of settled term configs, in its batches' shapes.

    Args:
        views: the consistency has views (prepared, or the encoder's own).
        state: the run's terms' state.
        encoder: a fine-tuned encoder, which makes the views of `view_share` of the captions.
    """
    attention = decoder.config.attention
    terms = objective_terms(terms_cfg, attention=attention, hard=hard, views=views, state=state, targets=targets)
    return Objective(
        decoder,
        terms,
        shapes=shapes,
        semi_sampling=hard.semi_sampling if attention == "hard" else None,
        encoder=encoder,
        view_share=view_share,
    )
