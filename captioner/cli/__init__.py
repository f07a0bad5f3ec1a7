"""The command lines: `captioner` (caption, demo, export) and `train.py` / `captioner-train`
(prepare, fit, evaluate)."""
