"""Where a model comes from:

best.pt                          a training checkpoint (`models.checkpoint`)
runs/demo-export/                an exported folder (`models.exported`)
https://host/best.pt#sha256=HEX  a pinned URL of a checkpoint, or of a .zip of an exported folder
hf://ORG/NAME[@REVISION]         an exported folder on the Hub, through huggingface_hub's cache
                                 (HF_HUB_OFFLINE=1 reads the cache only)
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
import zipfile
from urllib.parse import urlsplit, urlunsplit

import torch

from captioner.errors import CaptionerError
from captioner.models.checkpoint import Trained, load_checkpoint, read_trained
from captioner.models.exported import FILES, read_exported

_SHA256 = re.compile(r"sha256=([0-9a-fA-F]{64})")


def is_url(source: str) -> bool:
    """True for `scheme://...` sources (http, https, file), False for local paths."""
    return bool(re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", source))


def split_pinned_url(url: str) -> tuple[str, str]:
    """`URL#sha256=HEX` → (URL without the fragment, lower-case hex digest); CaptionerError where the
    fragment is missing or is not a 64-digit sha256."""
    parts = urlsplit(url)
    match = _SHA256.fullmatch(parts.fragment)
    if match is None:
        raise CaptionerError(
            f"{url}: a checkpoint URL must pin its content with '#sha256=<64 hex digits>' "
            "(compute it with `sha256sum FILE`)"
        )
    return urlunsplit(parts._replace(fragment="")), match.group(1).lower()


def sha256_file(path: str, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def download_checkpoint(url: str, *, cache_dir: str | None = None, progress: bool = True) -> str:
    """Download a pinned checkpoint (`URL#sha256=HEX`) once and return its path in the cache (default:
    torch hub's `checkpoints/` directory). Raises CaptionerError where there is no pin, the download
    fails, or the file's sha256 differs (refused and deleted)."""
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


def resolve(source: str, *, cache_dir: str | None = None) -> str:
    """A local checkpoint file or exported folder for any source."""
    if source.startswith("hf://"):
        return from_hub(source)
    if is_url(source):
        path = download_checkpoint(source, cache_dir=cache_dir)
        return _unpacked(path) if _holds_a_folder(path) else path
    return source


def load_trained(source: str) -> Trained:
    """The model a source holds: a training checkpoint or an exported folder, wherever it is."""
    path = resolve(source)
    if os.path.isdir(path):
        return read_exported(path)
    return read_trained(load_checkpoint(path), path)


def from_hub(source: str) -> str:
    """`hf://ORG/NAME[@REVISION]` → the exported folder in huggingface_hub's cache (downloaded if needed).
    Raises CaptionerError for a malformed id, or a model not in the cache that cannot be had (offline,
    HF_HUB_OFFLINE=1, or not on the Hub)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    repo, _, revision = source.removeprefix("hf://").partition("@")
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise CaptionerError(f"{source}: expected hf://ORG/NAME or hf://ORG/NAME@REVISION")
    try:
        return snapshot_download(repo, revision=revision or None, allow_patterns=[*FILES, "README.md"])
    except LocalEntryNotFoundError:
        raise CaptionerError(
            f"{source}: not in the Hugging Face cache ({_hub_cache()}) and the Hub cannot be "
            "reached (offline, or HF_HUB_OFFLINE=1); download it once while online, or point "
            "HF_HUB_CACHE at a cache that holds it"
        ) from None
    except (RepositoryNotFoundError, HfHubHTTPError, OSError) as e:
        raise CaptionerError(f"{source}: cannot get it from the Hugging Face Hub ({type(e).__name__}: {e})") from None


def _hub_cache() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _holds_a_folder(path: str) -> bool:
    """A .zip of an exported folder (a checkpoint is a zip file too, but holds no config.json)."""
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as z:
        return any(os.path.basename(n) == "config.json" for n in z.namelist())


def _unpacked(path: str) -> str:
    """The exported folder a downloaded .zip holds, unpacked once beside it (whole or not at all)."""
    folder = os.path.splitext(path)[0]
    if os.path.isdir(folder):
        return folder
    tmp = f"{folder}.tmp{os.getpid()}"
    try:
        os.makedirs(tmp)
        with zipfile.ZipFile(path) as z:
            for name in z.namelist():
                if os.path.basename(name) in (*FILES, "README.md"):
                    with z.open(name) as src, open(os.path.join(tmp, os.path.basename(name)), "wb") as dst:
                        shutil.copyfileobj(src, dst)
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
