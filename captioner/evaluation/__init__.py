"""Evaluation: captioning a split, the coco-caption metrics, pointing against boxes, attention
health, and `evaluate` itself."""
