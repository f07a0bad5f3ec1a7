"""Image loading, defined once for feature extraction, the API, the app and notebooks."""

from __future__ import annotations

import io
import os
import re
import warnings

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from captioner.errors import ImageError

# Pillow's decompression-bomb guard: images above this many pixels are refused.
DEFAULT_MAX_PIXELS = 64_000_000


def set_max_pixels(limit: int | None) -> None:
    """Set Pillow's decompression-bomb limit (None keeps the default); never disables it."""
    Image.MAX_IMAGE_PIXELS = int(limit or DEFAULT_MAX_PIXELS)


set_max_pixels(None)


def _to_rgb(img: Image.Image) -> Image.Image:
    """Convert any Pillow mode to 8-bit RGB, keeping what the picture shows."""
    if img.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
        # 16/32-bit and float grayscale: stretch to 0..255 (convert("L") would clip at 255).
        arr = np.asarray(img, dtype=np.float64)
        lo, hi = float(arr.min()), float(arr.max())
        arr = (arr - lo) * (255.0 / (hi - lo)) if hi > lo else np.zeros_like(arr)
        img = Image.fromarray(arr.round().astype(np.uint8))  # mode L
    if img.mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        # Transparent pixels have no colour of their own: show them over white, as viewers do.
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        img = Image.alpha_composite(background, rgba)
    return img.convert("RGB")


def load_image(src, *, max_pixels: int | None = None) -> Image.Image:
    """Open an image from a path, bytes or a PIL image; return it upright (EXIF orientation) in RGB, the
    first frame of an animation. Raises `ImageError` for a file that is missing, empty, truncated, not an
    image, or over the pixel limit."""
    name = str(src) if isinstance(src, (str, os.PathLike)) else "the image"
    limit = max_pixels or Image.MAX_IMAGE_PIXELS
    try:
        with warnings.catch_warnings():
            # Pillow warns past its limit and raises past twice it: refuse both, with our message.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = src if isinstance(src, Image.Image) else Image.open(io.BytesIO(_read_bytes(src, name)))
            w, h = img.size
            if w < 1 or h < 1:
                raise ImageError(f"{name}: the image has no pixels ({w}x{h})")
            if w * h > limit:
                raise ImageError(
                    f"{name}: {w}x{h} = {w * h} pixels is over the limit of {limit} "
                    "(refused as a possible decompression bomb)"
                )
            if getattr(img, "n_frames", 1) > 1:
                img.seek(0)  # animations: caption the first frame
            img.load()
            img = ImageOps.exif_transpose(img)
        return _to_rgb(img)
    except ImageError:
        raise
    except FileNotFoundError:
        raise ImageError(f"{name}: no such file") from None
    except IsADirectoryError:
        raise ImageError(f"{name}: is a directory, not an image") from None
    except PermissionError:
        raise ImageError(f"{name}: permission denied") from None
    except UnidentifiedImageError:
        raise ImageError(f"{name}: not an image file Pillow can read") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        found = re.search(r"\((\d+) pixels\)", str(e))  # Pillow's message carries the pixel count
        count = f"{found.group(1)} pixels is" if found else "the image is"
        raise ImageError(
            f"{name}: {count} over the limit of {limit} (refused as a possible decompression bomb)"
        ) from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise ImageError(f"{name}: the image data is truncated or corrupt ({e})") from None


def _read_bytes(src, name: str) -> bytes:
    if isinstance(src, (bytes, bytearray)):
        data = bytes(src)
    else:
        with open(src, "rb") as f:
            data = f.read()
    if not data:
        raise ImageError(f"{name}: the file is empty (0 bytes)")
    return data
