"""Fetching dataset archives over HTTP: downloaded, checked before use, unpacked safely.

The official locations of the COCO 2014 files and of Karpathy's split are named here, once, with
their known sizes and checksums. A download is checked (size, then SHA-256 or MD5) before anything
is unpacked; a mirror's `SHA256SUMS` replaces the official size and checksum of each file it lists.
"""

from __future__ import annotations

import hashlib
import logging
import os
import posixpath
import re
import urllib.error
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass, replace

from captioner.data.archives import CHUNK, require_space, space_needed, unpack
from captioner.data.download import download, open_url, progress_bar, retry, size_of
from captioner.errors import CaptionerError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Remote:
    """One archive: its path under `base` (the official layout), the folder it becomes under the
    root (its one top-level folder, or all its members), and its size and checksums where known."""

    path: str
    base: str
    folder: str
    size: int | None = None
    md5: str | None = None
    sha256: str | None = None

    @property
    def name(self) -> str:
        return posixpath.basename(self.path)

    @property
    def url(self) -> str:
        return self.base + self.path


COCO = "http://images.cocodataset.org/"
KARPATHY = "https://cs.stanford.edu/people/karpathy/deepimagesent/"
ANNOTATIONS_MD5 = "0a379cfc70b0e71301e0f377548639bd"
# Smallest first, so that a wrong mirror or a missing file shows within seconds.
COCO_2014 = (
    Remote("annotations/annotations_trainval2014.zip", COCO, "annotations", 252_872_794, ANNOTATIONS_MD5),
    Remote("caption_datasets.zip", KARPATHY, "caption_datasets"),
    Remote("zips/val2014.zip", COCO, "val2014", 6_645_013_297, "a3d79f5ed8d289b7a7554ce06a5782b3"),
    Remote("zips/train2014.zip", COCO, "train2014", 13_510_573_713, "0da8c0bd3d6becc4dcb32757491aca88"),
)


def read_sums(base: str) -> dict[str, str]:
    """A mirror's SHA256SUMS (`sha256sum`'s format) as {relative path: hex}; {} when it has none."""
    url = base + "SHA256SUMS"

    def get() -> bytes | None:
        try:
            with open_url(url, "SHA256SUMS", allow=(404, 403, 410)) as resp:
                return resp.read()
        except urllib.error.HTTPError:
            return None

    raw, sums = retry(get), {}
    if raw is None:
        log.info(f"{url}: none; the official sizes and checksums apply")
    for k, line in enumerate((raw or b"").decode("utf-8", "replace").splitlines(), 1):
        m = re.fullmatch(r"\s*([0-9a-fA-F]{64})\s+\*?(?:\./)?(.+?)\s*", line)
        if not m and line.strip() and not line.lstrip().startswith("#"):
            raise CaptionerError(f"{url}: line {k}: expected 'SHA256  PATH' (sha256sum's format), got {line[:80]!r}")
        if m:
            sums[m[2]] = m[1].lower()
    return sums


def resolve(remotes: Sequence[Remote], mirror: str | None) -> list[Remote]:
    """The archives as found at `mirror`, a base URL holding them under their official paths."""
    if not mirror:
        return list(remotes)
    if urllib.parse.urlsplit(mirror).scheme not in ("http", "https"):
        raise CaptionerError(f"--mirror {mirror}: expected an http:// or https:// URL")
    base = mirror.rstrip("/") + "/"
    sums = read_sums(base)
    listed = [sums.get(r.path) or sums.get(r.name) for r in remotes]
    return [
        replace(r, base=base, **({"size": None, "md5": None, "sha256": s} if s else {}))
        for r, s in zip(remotes, listed)
    ]


def remote_size(r: Remote) -> int | None:
    """The archive's size: the known one, else what the server says (None if it does not say)."""

    def head() -> int | None:
        try:
            with open_url(r.url, r.name, method="HEAD", allow=(405, 501)) as resp:
                length = resp.headers.get("Content-Length", "")
                return int(length) if length.isdigit() else None
        except urllib.error.HTTPError:  # a server that answers GET only
            return None

    return r.size if r.size is not None else retry(head)


def verify(path: str, r: Remote, *, progress: bool = True) -> None:
    """Check a downloaded archive's size and checksum: a file that fails is removed, and `CaptionerError`
    raised."""
    actual, problem = os.path.getsize(path), None
    algorithm, expected = ("sha256", r.sha256) if r.sha256 else ("md5", r.md5)
    if r.size is not None and actual != r.size:
        problem = f"{actual:,} bytes, expected {r.size:,}"
    elif expected:
        digest = hashlib.new(algorithm)
        with open(path, "rb") as f, progress_bar(actual, f"checking {r.name}", progress) as bar:
            while chunk := f.read(CHUNK):
                digest.update(chunk)
                bar.update(len(chunk))
        if digest.hexdigest() != expected.lower():
            problem = f"its {algorithm} is {digest.hexdigest()}, expected {expected}"
    if problem:
        os.remove(path)
        raise CaptionerError(
            f"{r.name} from {r.url} is damaged or not the expected file ({problem}); it was removed "
            "without unpacking anything: run again to download it anew"
        )
    log.info(f"{r.name}: checked ({algorithm if expected else 'size only: no checksum is known'})")


def fetch(
    remotes: Sequence[Remote], root: str, *, mirror: str | None = None, keep: bool = False, progress: bool = True
) -> list[str]:
    """Download, check and unpack each archive whose folder is not yet under `root`; return the folders
    fetched. `mirror` holds them under their official relative paths; `keep` keeps ROOT/downloads/NAME."""
    todo = [r for r in remotes if not os.path.isdir(os.path.join(root, r.folder))]
    for r in remotes:
        if r not in todo:
            log.info(f"{r.folder}: already in {root}; {r.name} not fetched")
    if not todo:
        return []
    downloads = os.path.join(root, "downloads")
    os.makedirs(downloads, exist_ok=True)
    todo = resolve(todo, mirror)
    sizes = [remote_size(r) for r in todo]
    dests = [os.path.join(downloads, r.name) for r in todo]
    have = [size_of(d) or size_of(d + ".part") for d in dests]
    plan = [(s or h, h) for s, h in zip(sizes, have)]
    require_space(downloads, space_needed(plan, keep), "fetching " + ", ".join(r.name for r in todo))
    for r, size, dest in zip(todo, sizes, dests):
        if not os.path.exists(dest):
            download(r.url, dest, name=r.name, size=size, progress=progress)
        verify(dest, r, progress=progress)
        unpack(dest, root, r.folder, name=r.name, progress=progress)
        if not keep:
            os.remove(dest)
    return [os.path.join(root, r.folder) for r in todo]
