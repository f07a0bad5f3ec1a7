"""What captioning an image gives, the same from PyTorch and from onnxruntime; needs no torch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from captioner.decoding.beams import Hypothesis
from captioner.decoding.settings import Decoding
from captioner.models.contexts import ARGMAX, SAMPLE
from captioner.models.vocab import Vocabulary


@dataclass
class Caption:
    """A caption and where the model looked for each word."""

    text: str
    words: list[str]
    score: float  # log-probability of the caption, <end> included
    attention: np.ndarray  # (len(words), grid, grid): α used to produce each word (14×14 for VGG at 224)
    locations: list[tuple[int, int]] | None = None  # (row, col) chosen per word (hard: argmax/sample)
    alternatives: list[tuple[str, float]] = field(default_factory=list)  # (text, score) of every beam or sample
    samples: list[Caption] = field(default_factory=list)  # sampling: the n captions drawn, each with its maps
    size: tuple[int, int] = (0, 0)  # (width, height) of the upright image
    # Is the image like the training images? {"score", "unfamiliar", "message", "threshold"}
    # (models.familiarity); None when the checkpoint holds no training-feature statistics.
    familiarity: dict | None = None


class CaptionModel:
    """A trained model that captions images: a `Captioner` on PyTorch or an `OnnxCaptioner` on onnxruntime."""

    info: dict  # the model's record: metrics, the attention health check's verdict, its card

    def caption_batch(self, images: Sequence, beam_size: int | None = None, **settings) -> list[Caption]:
        raise NotImplementedError

    def caption(self, image, beam_size: int | None = None, **settings) -> Caption:
        """Caption one image; see `caption_batch` for the settings."""
        return self.caption_batch([image], beam_size=beam_size, **settings)[0]

    @property
    def attention_warning(self) -> str | None:
        """A line to show beside this model's heatmaps when its attention health check (`info["attention"]`,
        recorded by `fit`) found them not meaningful; None when they passed or are unjudged."""
        verdict = self.info.get("attention") or {}
        if verdict.get("meaningful") is not False:
            return None
        return (
            "This model's attention maps are not meaningful: the health check flagged them when it was "
            f"trained ({'; '.join(verdict.get('problems') or [])}), so the heatmaps may not show what the words "
            "name."
        )


def captions(
    found: list[list[Hypothesis]],
    vocab: Vocabulary,
    grid: int,
    settings: Decoding,
    sizes: Sequence[tuple[int, int]],
    verdicts: Sequence[dict | None],
) -> list[Caption]:
    """Each image's caption from its hypotheses (beams best first, or samples): the first, with the others
    as its alternatives (and samples), its size and its familiarity verdict."""
    out = []
    for hyps, size, verdict in zip(found, sizes, verdicts):
        made = [_caption(h, vocab, grid, settings) for h in hyps]
        out.append(
            replace(
                made[0],
                alternatives=[(c.text, c.score) for c in made],
                samples=made if settings.how.draws else [],
                size=size,
                familiarity=verdict,
            )
        )
    return out


def _caption(hyp: Hypothesis, vocab: Vocabulary, grid: int, settings: Decoding) -> Caption:
    words = vocab.decode(hyp.tokens)
    locs = None
    if settings.context in (ARGMAX, SAMPLE):
        locs = [(int(l) // grid, int(l) % grid) for l in hyp.locations]
    return Caption(
        text=" ".join(words),
        words=words,
        score=hyp.score,
        attention=hyp.attention.reshape(len(words), grid, grid),
        locations=locs,
    )
