"""Attention heatmaps as serving imports them: drawn a layer below, so that training draws with them too."""

from captioner.evaluation.heatmaps import OPACITY, attention_figure, figure_png, fit_side, word_overlays

__all__ = ["OPACITY", "attention_figure", "figure_png", "fit_side", "word_overlays"]
