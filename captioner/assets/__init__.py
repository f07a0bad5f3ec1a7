"""The bundled demo model and its example images.

`demo.pt` is a small soft-attention model trained on the package's synthetic scenes with the
seeded random VGG16 encoder (no ImageNet weights), so the web demo runs offline on a fresh
machine. It is rebuilt by `python -m captioner.assets.build` (see README). It knows coloured
shapes only: real photos need a COCO-trained checkpoint.
"""
from __future__ import annotations

import os

HERE = os.path.dirname(os.path.abspath(__file__))
DEMO_CHECKPOINT = os.path.join(HERE, "demo.pt")
EXAMPLES_DIR = os.path.join(HERE, "examples")


def demo_checkpoint() -> str:
    """Path of the bundled demo checkpoint."""
    if not os.path.isfile(DEMO_CHECKPOINT):
        from ..errors import CaptionerError
        raise CaptionerError(f"{DEMO_CHECKPOINT} is missing; rebuild it with `python -m captioner.assets.build`")
    return DEMO_CHECKPOINT


def example_images() -> list[str]:
    """Paths of the example scenes shipped with the demo model."""
    if not os.path.isdir(EXAMPLES_DIR):
        return []
    return sorted(os.path.join(EXAMPLES_DIR, f) for f in os.listdir(EXAMPLES_DIR)
                  if f.lower().endswith((".png", ".jpg", ".jpeg")))
