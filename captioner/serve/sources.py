"""The bundled demo model and its example scenes, and the model a program serves by default.

The bundled model knows the synthetic scenes of coloured shapes only: its VGG16 encoder has seeded random
weights (no ImageNet download), so the demo runs offline on a fresh machine.
"""

from __future__ import annotations

import os

from captioner.errors import CaptionerError

ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")
DEMO_MODEL = os.path.join(ASSETS, "demo")
EXAMPLES_DIR = os.path.join(ASSETS, "examples")


def demo_model() -> str:
    """Path of the bundled demo model (an exported folder)."""
    if not os.path.isdir(DEMO_MODEL):
        raise CaptionerError(
            f"{DEMO_MODEL} is missing; reinstall captioner, or rebuild it from a source checkout with "
            "`python -m tools.build_demo`"
        )
    return DEMO_MODEL


def example_images() -> list[str]:
    """Paths of the example scenes shipped with the demo model."""
    if not os.path.isdir(EXAMPLES_DIR):
        return []
    return sorted(
        os.path.join(EXAMPLES_DIR, f) for f in os.listdir(EXAMPLES_DIR) if f.lower().endswith((".png", ".jpg", ".jpeg"))
    )


def model_source(source: str | None) -> str:
    """The model to serve: the bundled demo model for None, else the source as given."""
    return source or demo_model()
