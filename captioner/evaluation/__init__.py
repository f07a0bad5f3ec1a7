"""Evaluation: captioning a split, the coco-caption metrics, pointing against boxes, attention
health, the attention figures, and `evaluate` itself."""
