"""Evaluation: captioning a split, the coco-caption metrics, pointing against boxes, attention
health, the familiarity of an image, and `evaluate` itself."""
