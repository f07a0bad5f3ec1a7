"""The command lines: `captioner` (caption, demo, export, selfcheck) and `train.py` (prepare, fit, evaluate, coco)."""
