"""What the web demo shows of a captioned image: its `View` and the pieces of the page drawn from it.

Symbols: n words, g×g attention grid.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
from PIL import Image

from captioner.models.preprocess import Preprocess
from captioner.serve import heatmaps as viz
from captioner.serve.api import Caption

VIEW_SIDE = 512  # longest side of the stored image and the large heatmap: enough for a screen
THUMB_SIDE = 160  # longest side of the per-word thumbnails, about the size the gallery shows


@dataclass
class View:
    """What one captioned image leaves in a session: enough to redraw every heatmap."""

    image: Image.Image  # upright RGB, longest side VIEW_SIDE
    thumb: Image.Image  # the same, longest side THUMB_SIDE
    text: str
    words: list[str]
    attention: np.ndarray  # (n, g, g)
    locations: list[tuple[int, int]] | None
    preprocess: Preprocess  # tells viz which part of the image the grid covers
    selected: int = 0  # the word shown large
    # Heatmaps drawn so far at `opacity`: ("thumbs",) → list, ("large", k) → image, ("figure",) → path.
    drawn: dict = field(default_factory=dict)
    opacity: float | None = None

    def drawn_at(self, opacity: float) -> dict:
        """The cache of what is drawn at this opacity (emptied when the opacity changes)."""
        if opacity != self.opacity:
            self.drawn, self.opacity = {}, opacity
        return self.drawn


def fit_view(image: Image.Image) -> Image.Image:
    """Scale to VIEW_SIDE on the longest side: tiny images become visible, huge ones light."""
    return viz.fit_side(image, VIEW_SIDE)


def caption_data(out: Caption, decimals: int = 6) -> dict:
    return {
        "caption": out.text,
        "words": out.words,
        "score": float(out.score),
        "attention": np.round(out.attention.astype(np.float64), decimals).tolist(),
        "alternatives": [{"caption": text, "log_prob": float(lp)} for text, lp in out.alternatives],
        "locations": [list(loc) for loc in out.locations] if out.locations is not None else None,
        "image_size": list(out.size),
        "familiarity": out.familiarity,
    }


def highlighted(view: View) -> list[tuple[str, str]]:
    """The caption as (word, label) tokens for gr.HighlightedText; the shown word stands out."""
    return [(w, "shown" if i == view.selected else "word") for i, w in enumerate(view.words)]


def familiarity_html(verdict: dict | None) -> str:
    """The line beside the caption saying whether the image is like the training images."""
    if verdict is None:
        return ""
    kind = "unfamiliar" if verdict["unfamiliar"] else "familiar"
    mark = "⚠" if verdict["unfamiliar"] else "✓"
    return f'<p class="familiarity {kind}">{mark} {html.escape(verdict["message"])}</p>'


def error_html(message: str) -> str:
    return f'<p class="image-error" role="alert">⚠ {html.escape(message)}</p>'


# What a word's map shows, as the large view's label says it (`Decoding.maps`): where, and what brighter means.
SHOWN = {"attention": ("looked for", "more attention"), "posterior": ("read", "more of the word's evidence")}


def large_label(view: View, maps: str = "attention", warning: str | None = None) -> str:
    k = view.selected
    where, brighter = SHOWN[maps]
    return (
        f'Where the model {where} **"{view.words[k]}"** (word {k + 1} of {len(view.words)}); '
        f"brighter means {brighter}" + (f" (⚠ {warning})" if warning else "")
    )


class WordView(NamedTuple):
    """The outputs a clicked word changes: the words (one selected), its label, its large heatmap, the gallery."""

    words: object
    large_label: object
    large: object
    gallery: object


class PageOutputs(NamedTuple):
    """Every output of the page's caption event; `flat()` in the order app.py lists the components (`names`)."""

    image: object  # the input image (set when an example is chosen), else gr.skip()
    error: object  # the one error line next to the image
    caption: object
    familiarity: object  # "like / unlike the training images", next to the caption
    view: WordView
    alternatives: object
    data: object
    download: object
    session: object

    @classmethod
    def names(cls) -> list[str]:
        return [n for f in cls._fields for n in (WordView._fields if f == "view" else [f])]

    def flat(self) -> tuple:
        return tuple(x for v in self for x in (v if isinstance(v, WordView) else [v]))
