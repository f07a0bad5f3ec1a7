"""Where the web demo's checkpoint comes from: the bundled model, a local file, or a checked URL.

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

from .assets import demo_checkpoint
from .errors import CaptionerError

_SHA256 = re.compile(r"sha256=([0-9a-fA-F]{64})")


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
        raise CaptionerError(f"{url}: a checkpoint URL must pin its content with '#sha256=<64 hex digits>' "
                             "(compute it with `sha256sum FILE`)")
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
