"""Evaluation: captioning a split and scoring the captions and their attention."""
