"""Reading the web demo's uploads: the file as sent, named as the user knows it, decoded once."""

from __future__ import annotations

import os
import urllib.parse

import gradio as gr
from gradio.utils import get_upload_folder
from gradio_client.utils import decode_base64_to_binary
from PIL import Image

from captioner.data.images import load_image
from captioner.errors import ImageError


def upload_source(payload: dict | str | None) -> str | bytes | None:
    """The uploaded file from gr.Image's raw payload: its path, or bytes for a data URL. The caption events
    skip gr.Image's own preprocessing, which opens each upload with Pillow and re-encodes non-RGB ones: odd
    files would fail with Pillow's bare exception before our handler runs, and 16-bit images be clipped."""
    if payload is None or isinstance(payload, str):  # a path: direct calls
        return payload
    if (payload.get("url") or "").startswith("data:"):  # webcam/clipboard sent inline
        return decode_base64_to_binary(payload["url"])[0]
    if payload.get("path") is None and FILE_ROUTE in (payload.get("url") or ""):
        return _served(payload["url"])
    return payload["path"]


FILE_ROUTE = "/gradio_api/file="  # where the server serves the files it put on the page


def _served(url: str) -> str:
    """The file behind a URL the server gave the page (an example it showed in the input): its copy in
    Gradio's cache. A URL naming a file anywhere else is refused."""
    path = os.path.realpath(urllib.parse.unquote(url.split(FILE_ROUTE, 1)[1]))
    cache = os.path.realpath(get_upload_folder())
    if os.path.commonpath([path, cache]) != cache:
        raise gr.Error(f"{os.path.basename(path)}: not an image this page was given", print_exception=False)
    return path


def upload_name(payload: dict | str | None) -> str | None:
    """The name the user knows the upload by (its own file name, not the server's cache path)."""
    if isinstance(payload, dict) and payload.get("orig_name"):
        return os.path.basename(payload["orig_name"])
    source = upload_source(payload)
    return os.path.basename(source) if isinstance(source, str) else None


def read_upload(payload: dict | str | None) -> Image.Image:
    """Decode an upload; errors become a gr.Error about that image, named as the user knows it."""
    image = upload_source(payload)
    if image is None:
        raise gr.Error("No image: upload, paste or take one first.", title="No image", print_exception=False)
    try:
        return load_image(image)
    except ImageError as e:
        message = str(e).replace(image, upload_name(payload)) if isinstance(image, str) else str(e)
        raise gr.Error(message, title="Cannot read this image", duration=None, print_exception=False) from None
