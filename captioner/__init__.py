"""captioner: "Show, Attend and Tell" (Xu et al., 2015) as software.

from captioner import Captioner
cap = Captioner.load("best.pt")
out = cap.caption("photo.jpg", beam_size=3)   # out.text, out.words, out.attention (n, 14, 14)
"""

from captioner.errors import CaptionerError, ImageError

__all__ = ["Caption", "Captioner", "CaptionerError", "ImageError"]
__version__ = "0.2.0"


def __getattr__(name: str):
    # The API loads torch: imported when asked for, so that the scene generators and the CLI's help start fast.
    if name in ("Caption", "Captioner"):
        from captioner.serve import api

        return getattr(api, name)
    raise AttributeError(f"module 'captioner' has no attribute {name!r}")
