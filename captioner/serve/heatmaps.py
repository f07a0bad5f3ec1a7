"""Attention heatmaps as serving imports them: drawn a layer below, so that training draws with them too."""

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
