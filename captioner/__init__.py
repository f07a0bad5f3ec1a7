"""captioner: "Show, Attend and Tell" (Xu et al., 2015) as software.

from captioner import Captioner
cap = Captioner.load("best.pt")
out = cap.caption("photo.jpg", beam_size=3)   # out.text, out.words, out.attention (n, 14, 14)
"""

from captioner.errors import CaptionerError, ImageError
from captioner.serve.api import Caption, Captioner

__all__ = ["Caption", "Captioner", "CaptionerError", "ImageError"]
__version__ = "0.2.0"
