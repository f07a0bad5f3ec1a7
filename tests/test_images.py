"""Image loading: every valid image becomes upright RGB; every bad one gets a message about it."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from captioner.data.images import load_image
from captioner.errors import ImageError


def encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def colourful(w=40, h=30) -> Image.Image:
    arr = np.zeros((h, w, 3), np.uint8)
    arr[..., 0] = np.linspace(0, 255, w, dtype=np.uint8)[None]
    arr[..., 2] = 200
    return Image.fromarray(arr)


@pytest.mark.parametrize(
    "make",
    [
        lambda: encode(colourful().convert("L"), "PNG"),
        lambda: encode(colourful().convert("RGBA"), "PNG"),
        lambda: encode(colourful().convert("P"), "PNG"),
        lambda: encode(colourful().convert("CMYK"), "JPEG"),
        lambda: encode(colourful().convert("1"), "PNG"),
        lambda: encode(colourful().convert("LA"), "PNG"),
        lambda: encode(Image.new("RGB", (1, 1), (9, 9, 9)), "PNG"),
        lambda: encode(Image.new("RGB", (2000, 3), (9, 9, 9)), "JPEG"),
        lambda: encode(colourful(), "WEBP"),
        lambda: encode(colourful(), "BMP"),
        lambda: encode(colourful(), "TIFF"),
    ],
    ids=["L", "RGBA", "P", "CMYK", "1bit", "LA", "1x1", "wide", "webp", "bmp", "tiff"],
)
def test_modes_become_rgb(make):
    img = load_image(make())
    assert img.mode == "RGB" and img.size[0] >= 1


def test_16_bit_grayscale_keeps_its_contrast():
    arr = np.tile(np.linspace(0, 65535, 64, dtype=np.uint16), (8, 1))
    img = load_image(encode(Image.fromarray(arr), "PNG"))
    out = np.asarray(img)[..., 0]
    assert out.min() == 0 and out.max() == 255  # not clipped to white


def test_transparent_pixels_are_shown_over_white():
    rgba = Image.new("RGBA", (4, 4), (0, 0, 0, 0))
    assert np.asarray(load_image(encode(rgba, "PNG"))).min() == 255


def test_exif_rotation_is_applied():
    img = colourful(40, 20)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90° clockwise to display
    out = load_image(encode(img, "JPEG", exif=exif.tobytes()))
    assert out.size == (20, 40)


def test_animated_gif_gives_first_frame():
    frames = [Image.new("RGB", (8, 8), c) for c in ((255, 0, 0), (0, 255, 0))]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:])
    out = np.asarray(load_image(buf.getvalue()))
    assert out[4, 4, 0] > 200 and out[4, 4, 1] < 50


@pytest.mark.parametrize(
    "data, message",
    [
        (b"", "empty"),
        (b"this is not an image at all", "not an image"),
        (encode(colourful(200, 200), "JPEG")[:300], "truncated or corrupt"),
        (encode(colourful(200, 200), "PNG")[:120], "truncated or corrupt"),
    ],
)
def test_bad_bytes_are_explained(data, message):
    with pytest.raises(ImageError, match=message):
        load_image(data)


def test_decompression_bomb_is_refused():
    data = encode(Image.new("L", (3000, 3000)), "PNG")  # tiny file, 9 Mpixel
    with pytest.raises(ImageError, match="decompression bomb"):
        load_image(data, max_pixels=1_000_000)


def test_missing_file_named(tmp_path):
    with pytest.raises(ImageError, match="nope.jpg: no such file"):
        load_image(tmp_path / "nope.jpg")
    with pytest.raises(ImageError, match="directory"):
        load_image(tmp_path)
