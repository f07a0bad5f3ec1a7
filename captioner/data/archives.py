"""Archives on disk: how much room they need, and unpacking one safely, whole or not at all.

A zip unpacks into a hidden folder beside its target and is renamed into place whole, so a killed
unpack is done again, never half used.
"""

from __future__ import annotations

import logging
import os
import shutil
import zipfile
from collections.abc import Sequence

from tqdm import tqdm

from captioner.errors import CaptionerError
from captioner.io import disk_error

log = logging.getLogger(__name__)

CHUNK = 1 << 20


def size_text(n: float) -> str:
    """Bytes in words: '13.5 GB', '200.7 kB'."""
    for unit in ("bytes", "kB", "MB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def require_space(path: str, needed: int, what: str) -> None:
    """Say how much `what` needs on the device holding `path` and how much is free; refuse if short."""
    where = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    free = shutil.disk_usage(where).free
    log.info(f"{what}: needs {size_text(needed)} on the device holding {where}; {size_text(free)} free")
    if needed > free:
        raise CaptionerError(
            f"{what} needs {size_text(needed)}, but the device holding {where} has {size_text(free)} free; "
            "free some space or choose a root folder on a larger disk"
        )


def space_needed(plan: Sequence[tuple[int, int]], keep: bool) -> int:
    """Most bytes held at once while fetching and unpacking archives (size, bytes already there) in
    order, their contents as large as they are, each removed once unpacked unless `keep`."""
    held = peak = 0
    for size, have in plan:
        peak = max(peak, held + (size - have) + size)  # the rest of the zip, then its contents beside it
        held += size + (size - have if keep else -have)
    return peak


def _unsafe(info: zipfile.ZipInfo) -> bool:
    parts = info.filename.replace("\\", "/").split("/")
    link = (info.external_attr >> 16) & 0o170000 == 0o120000
    return link or info.filename.startswith(("/", "\\")) or ":" in parts[0] or ".." in parts


def unpack(archive: str, root: str, folder: str, *, name: str, progress: bool = True) -> str:
    """Unpack a checked zip to ROOT/folder, whole or not at all, and return that folder. Raises
    `CaptionerError` when the zip is unreadable or damaged, a member would land outside the folder, or the
    disk has too little room for its contents."""
    target, tmp = os.path.join(root, folder), os.path.join(root, f".{folder}.unpacking")
    shutil.rmtree(tmp, ignore_errors=True)  # what a killed unpack left
    try:
        zf = zipfile.ZipFile(archive)
    except (zipfile.BadZipFile, OSError) as e:
        raise CaptionerError(f"{name}: not a readable zip ({e})") from None
    with zf, tqdm(total=len(zf.infolist()), unit="file", desc=f"unpacking {name}", disable=not progress) as bar:
        bad = [m.filename for m in zf.infolist() if _unsafe(m)]
        if bad:
            raise CaptionerError(f"{name}: refused: member {bad[0]!r} would be written outside {target}")
        require_space(root, sum(m.file_size for m in zf.infolist()), f"unpacking {name}")
        for m in zf.infolist():
            path = os.path.join(tmp, *[p for p in m.filename.replace("\\", "/").split("/") if p])
            try:
                os.makedirs(path if m.is_dir() else os.path.dirname(path), exist_ok=True)
                if not m.is_dir():
                    with zf.open(m) as src, open(path, "wb") as dst:
                        shutil.copyfileobj(src, dst, CHUNK)
            except (zipfile.BadZipFile, EOFError) as e:
                raise CaptionerError(f"{name}: {m.filename} is damaged ({e})") from None
            except OSError as e:
                raise disk_error(e, path, f"{m.filename} of {name} to") from None
            bar.update()
    inner = os.path.join(tmp, folder)
    os.replace(inner if os.listdir(tmp) == [folder] and os.path.isdir(inner) else tmp, target)
    shutil.rmtree(tmp, ignore_errors=True)
    log.info(f"{name}: unpacked to {target}")
    return target
