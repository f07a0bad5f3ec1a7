"""Where a model comes from: the bundled demo model, a local file, or a checked URL.

The bundled model (`captioner/assets/`) is a small soft-attention model trained on the package's
synthetic scenes with the seeded random VGG16 encoder (no ImageNet weights), so the demo runs
offline on a fresh machine; it knows coloured shapes only. `python -m captioner.demo.build`
rebuilds it, with the example scenes beside it.

A URL must pin its content, `URL#sha256=<64 hex digits>`: it is downloaded once into torch's
hub cache (`$TORCH_HOME/hub/checkpoints/`, as torchvision's weights are), its sha256 is checked
before it is used, and a file whose digest differs is refused and deleted.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from urllib.parse import urlsplit, urlunsplit

import torch

from captioner.errors import CaptionerError

ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")
DEMO_CHECKPOINT = os.path.join(ASSETS, "demo.pt")
EXAMPLES_DIR = os.path.join(ASSETS, "examples")
_SHA256 = re.compile(r"sha256=([0-9a-fA-F]{64})")


def demo_checkpoint() -> str:
    """Path of the bundled demo checkpoint."""
    if not os.path.isfile(DEMO_CHECKPOINT):
        raise CaptionerError(f"{DEMO_CHECKPOINT} is missing; rebuild it with `python -m captioner.demo.build`")
    return DEMO_CHECKPOINT


def example_images() -> list[str]:
    """Paths of the example scenes shipped with the demo model."""
    if not os.path.isdir(EXAMPLES_DIR):
        return []
    return sorted(
        os.path.join(EXAMPLES_DIR, f) for f in os.listdir(EXAMPLES_DIR) if f.lower().endswith((".png", ".jpg", ".jpeg"))
    )


def is_url(source: str) -> bool:
    """True for `scheme://...` sources (http, https, file), False for local paths."""
    return bool(re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", source))


def split_pinned_url(url: str) -> tuple[str, str]:
    """`URL#sha256=HEX` → (URL without the fragment, lower-case hex digest).

    Raises:
        CaptionerError: the fragment is missing or is not a 64-digit sha256.
    """
    parts = urlsplit(url)
    match = _SHA256.fullmatch(parts.fragment)
    if match is None:
        raise CaptionerError(
            f"{url}: a checkpoint URL must pin its content with '#sha256=<64 hex digits>' "
            "(compute it with `sha256sum FILE`)"
        )
    return urlunsplit(parts._replace(fragment="")), match.group(1).lower()


def sha256_file(path: str, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def download_checkpoint(url: str, *, cache_dir: str | None = None, progress: bool = True) -> str:
    """Download a pinned checkpoint once and return its path in the cache.

    Args:
        url: `URL#sha256=HEX`.
        cache_dir: where to keep it (default: torch hub's `checkpoints/` directory).
        progress: show a progress bar while downloading.

    Returns:
        The path of the verified file; a cached file with the right digest is reused.

    Raises:
        CaptionerError: no pin, the download fails, or the file's sha256 differs (refused).
    """
    bare, digest = split_pinned_url(url)
    cache_dir = cache_dir or os.path.join(torch.hub.get_dir(), "checkpoints")
    stem, ext = os.path.splitext(os.path.basename(urlsplit(bare).path) or "checkpoint.pt")
    # The digest prefix in the name keeps two different `best.pt` URLs from evicting each other.
    path = os.path.join(cache_dir, f"{stem}-{digest[:8]}{ext or '.pt'}")
    if os.path.isfile(path) and sha256_file(path) == digest:
        return path
    os.makedirs(cache_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache_dir, prefix=".download-", suffix=ext)
    os.close(fd)
    try:
        try:
            torch.hub.download_url_to_file(bare, tmp, progress=progress)
        except Exception as e:  # URLError, HTTPError, OSError: say which URL and why
            raise CaptionerError(f"{bare}: cannot download the checkpoint ({type(e).__name__}: {e})") from None
        got = sha256_file(tmp)
        if got != digest:
            raise CaptionerError(f"{bare}: refused: sha256 of the download is {got}, the URL pins {digest}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def resolve_checkpoint(source: str | None, *, cache_dir: str | None = None) -> str:
    """The checkpoint file to serve: the bundled demo model, a local path, or a pinned URL.

    Args:
        source: None for the bundled model, a path, or `URL#sha256=HEX`.
        cache_dir: download cache for URLs (default: torch hub's).
    """
    if not source:
        return demo_checkpoint()
    if is_url(source):
        return download_checkpoint(source, cache_dir=cache_dir)
    return source
