"""Resumable HTTP downloads: NAME.part continued with Range requests, transient failures retried.

A file takes its own name only once complete. A lost connection or a 5xx answer is tried again until
RETRIES attempts in a row got no byte further.
"""

from __future__ import annotations

import http.client
import logging
import os
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable

from tqdm import tqdm

from captioner.data.archives import CHUNK, size_text
from captioner.errors import CaptionerError
from captioner.io import disk_error

log = logging.getLogger(__name__)

TIMEOUT = 60  # seconds without a byte before a connection counts as lost
RETRIES = 3  # failed attempts in a row, none getting a byte further, before giving up
RETRY_WAIT = 2.0  # seconds, times the failures in a row


class Transient(Exception):
    """A failure that trying again may cure: a lost connection, a 5xx answer."""


def _reason(err: BaseException) -> str:
    err = getattr(err, "reason", err)
    return (getattr(err, "strerror", None) or str(err) or type(err).__name__).lower()


def progress_bar(total: int | None, desc: str, progress: bool, initial: int = 0) -> tqdm:
    """A byte counter for a download or a checksum (hidden unless `progress`)."""
    kw = dict(unit="B", unit_scale=True, unit_divisor=1024, desc=desc, disable=not progress)
    return tqdm(total=total, initial=initial, **kw)


def size_of(path: str) -> int:
    return os.path.getsize(path) if os.path.exists(path) else 0


def open_url(url: str, name: str, headers: dict | None = None, method: str = "GET", allow: tuple[int, ...] = ()):
    """The server's answer; `allow`ed error codes as HTTPError, other 4xx as CaptionerError, what
    may pass (no connection, 5xx) as `Transient`."""
    try:
        return urllib.request.urlopen(
            urllib.request.Request(url, headers=headers or {}, method=method), timeout=TIMEOUT
        )
    except urllib.error.HTTPError as e:
        if e.code in allow:
            raise
        text = f"{name}: {url} answered {e.code} {e.reason}"
        raise (Transient if e.code >= 500 or e.code in (408, 429) else CaptionerError)(text) from None
    except (OSError, http.client.HTTPException) as e:  # URLError is an OSError
        raise Transient(f"{name}: cannot connect to {url}: {_reason(e)}") from None


def retry(action: Callable, moved: Callable[[], bool] = lambda: False, hint: Callable[[], str] = lambda: ""):
    """`action()`, tried again after each `Transient` failure until RETRIES in a row made no progress."""
    failures = 0
    while True:
        try:
            return action()
        except Transient as e:
            failures = 0 if moved() else failures + 1
            if failures > RETRIES:
                raise CaptionerError(f"{e} (tried {failures} times in a row){hint()}") from None
            log.warning(f"{e}; trying again")
            time.sleep(RETRY_WAIT * failures)


def download(url: str, dest: str, *, name: str, size: int | None = None, progress: bool = True) -> None:
    """Fetch `url` to `dest`, going on from `dest`.part; `dest` appears only once complete. Raises
    `CaptionerError` when the server refuses (4xx), keeps failing, or offers a file of another size than
    `size`, or when the disk fails."""
    part, before = dest + ".part", [0]

    def attempt() -> None:
        before[0] = size_of(part)
        _attempt(url, part, name, size, progress)

    hint = lambda: f"; run again to go on from the {size_text(size_of(part))} in {part}"
    retry(attempt, moved=lambda: size_of(part) > before[0], hint=hint)
    os.replace(part, dest)
    log.info(f"{name}: downloaded from {url}")


def _attempt(url: str, part: str, name: str, size: int | None, progress: bool) -> None:
    """One request for the rest of the file, appended to `part`."""
    have = size_of(part)
    if size is not None and have >= size:  # complete, or not a beginning of this file
        if have == size:
            return
        os.remove(part)
        have = 0
    try:
        resp = open_url(url, name, {"Range": f"bytes={have}-"} if have else None, allow=(416,))
    except urllib.error.HTTPError:  # 416: nothing lies after byte `have`
        if size is None:
            return
        os.remove(part)
        raise Transient(f"{name}: {url} holds less than the {size_text(have)} in {part}; starting again") from None
    with resp:
        got = re.match(r"bytes (\d+)-\d+/(\d+)", resp.headers.get("Content-Range", "")) if resp.status == 206 else None
        if resp.status == 206 and not (got and int(got[1]) == have):
            os.remove(part)
            raise Transient(f"{name}: {url} answered another range than the one asked for; starting again")
        have = have if got else 0  # without a range the server sends the whole file
        length = resp.headers.get("Content-Length", "")
        total = int(got[2]) if got else int(length) if length.isdigit() else None
        if size is not None and total is not None and total != size:
            raise CaptionerError(
                f"{name}: {url} is {total:,} bytes, but {name} is {size:,}: not the expected file "
                "(a mirror's SHA256SUMS, when it lists the file, replaces the official size)"
            )
        try:
            f = open(part, "ab" if have else "wb")
        except OSError as e:
            raise disk_error(e, part, "the download") from None
        with f, progress_bar(total, name, progress, have) as bar:
            while True:
                try:
                    chunk = resp.read1(CHUNK)
                except (OSError, http.client.HTTPException) as e:
                    raise Transient(f"{name}: the connection to {url} dropped ({_reason(e)})") from None
                if not chunk:
                    break
                try:
                    f.write(chunk)
                except OSError as e:
                    raise disk_error(e, part, "the download") from None
                have += len(chunk)
                bar.update(len(chunk))
    if total is not None and have < total:
        raise Transient(f"{name}: the connection to {url} closed after {have:,} of {total:,} bytes")
