"""Attention heatmaps for the CLI, the web demo and the notebooks, as serving imports them.

They are drawn in `evaluation.heatmaps`, a layer below, so that `fit --tensorboard` (training, which
may not import serving) draws its validation examples with the same code.
"""

from captioner.evaluation.heatmaps import (
    CMAP,
    OPACITY,
    attention_figure,
    figure_png,
    fit_side,
    overlay,
    word_overlays,
)

__all__ = ["CMAP", "OPACITY", "attention_figure", "figure_png", "fit_side", "overlay", "word_overlays"]
