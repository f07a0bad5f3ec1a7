"""Files read and written safely: reads whose errors name the file, failed writes described in words that
name the place, and `atomic_path`, through which every file the package writes whole goes, so that a reader
sees the old file or the complete new one, never half of one."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pickle
import re
import shutil
from collections.abc import Iterator

from captioner.errors import CaptionerError


def read_json(path: str, what: str):
    """Parse a JSON file, turning every failure into a message that names the file."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise CaptionerError(f"{path}: no such file ({what})") from None
    except IsADirectoryError:
        raise CaptionerError(f"{path}: is a directory, expected a {what} file") from None
    except OSError as e:
        raise CaptionerError(f"{path}: cannot read it ({e.strerror})") from None
    if not raw.strip():
        raise CaptionerError(f"{path}: the file is empty (expected {what} JSON)")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise CaptionerError(f"{path}: not UTF-8 text (byte {e.start}); JSON must be UTF-8") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        ends_open = not text.rstrip().endswith(("}", "]"))
        hint = " (the file looks truncated: it ends before the JSON is complete)" if ends_open else ""
        raise CaptionerError(f"{path}: malformed JSON at line {e.lineno} column {e.colno}: {e.msg}{hint}") from None


def read_folder_config(folder: str, files: tuple[str, ...], *, kind: str, fmt: str, version: int) -> dict:
    """A model folder's config.json, once every one of `files` is there and the config is of format `fmt`
    at a version up to `version`; each failure names the file (`kind`: "exported model", "ONNX model")."""
    missing = [name for name in files if not os.path.isfile(os.path.join(folder, name))]
    if missing:
        raise CaptionerError(f"{folder}: missing {', '.join(missing)} (an {kind} holds {', '.join(files)})")
    path = os.path.join(folder, "config.json")
    config = read_json(path, f"{kind} config")
    if not isinstance(config, dict) or config.get("format") != fmt:
        raise CaptionerError(f"{path}: not a captioner {kind} config (expected format {fmt!r})")
    if not isinstance(config.get("version"), int) or config["version"] > version:
        raise CaptionerError(
            f"{path}: version {config.get('version')!r} was written by a newer captioner; "
            f"this one reads up to version {version}: upgrade captioner"
        )
    return config


def read_torch(path: str, *, name: str, kind: str, hint: str = "", map_location="cpu"):
    """`torch.load` with weights_only: a file that needs the full unpickler is refused, its code never run.
    Raises CaptionerError naming the file `name` (its path, or the option that gave it) when it holds
    pickled objects, or is truncated, corrupt or not torch's format."""
    import torch  # here: reading JSON needs no torch

    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise CaptionerError(
            f"{name}: refused: the file holds pickled objects that only a full unpickler would run, not plain "
            f"tensors and values ({_first_line(e) or 'unsupported content'}){hint}"
        ) from None
    except Exception as e:  # zip/EOF errors from a truncated or foreign file
        raise CaptionerError(
            f"{name}: not a readable {kind}, truncated or corrupt ({type(e).__name__}: {_first_line(e)})"
        ) from None


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


@contextlib.contextmanager
def atomic_path(path: str) -> Iterator[str]:
    """A temporary path beside `path` to write the new file to; when the block ends without an error it is
    fsync'ed and renamed onto `path`, otherwise removed. It keeps `path`'s extension (numpy's savez
    appends ".npz" otherwise)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    _remove_orphans(folder)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp{os.getpid()}{os.path.splitext(path)[1]}")
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # some writers create their files private; what we write is meant to be read
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


_TEMPORARY = re.compile(r"\.(?P<name>.+)\.tmp(?P<pid>\d+)(?P<ext>\.[^./]*)?")


def _remove_orphans(folder: str) -> None:
    """Remove the temporary files `atomic_path` left in `folder` when its writer was killed (SIGKILL, power
    loss): those whose process no longer exists."""
    for entry in os.listdir(folder):
        m = _TEMPORARY.fullmatch(entry)
        if m and (m["ext"] or "") == os.path.splitext(m["name"])[1] and not _alive(int(m["pid"])):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(folder, entry))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def write_json_atomic(path: str, obj) -> None:
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f)


def _size(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} bytes"
    for unit in ("KB", "MB"):
        n /= 1024
        if n < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} GB"


def describe_os_error(err: OSError, path: str) -> str:
    """What a failed write to `path` (a file or its directory) means, in words that name the place:
    'no space left on ... (3 MB free)'."""
    where = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path)) or "."
    if err.errno == errno.ENOSPC:
        try:
            free = f" ({_size(shutil.disk_usage(where).free)} free)"
        except OSError:
            free = ""
        return f"no space left on the device holding {where}{free}"
    if err.errno == errno.EDQUOT:
        return f"disk quota exceeded on {where}"
    if err.errno == errno.EROFS:
        return f"{where} is on a read-only file system"
    if err.errno in (errno.EACCES, errno.EPERM):
        return f"permission denied writing in {where}"
    return f"{err.strerror or err} (writing in {where})"


def disk_error(err: OSError, path: str, what: str) -> CaptionerError:
    return CaptionerError(f"cannot write {what} {path}: {describe_os_error(err, path)}")


def check_free_space(path: str, needed: int, what: str) -> str | None:
    """Why a long write of `needed` more bytes to `path` will not fit, or None. A warning, not a refusal:
    free space moves while a job runs, and the write itself is what fails for certain."""
    where = os.path.dirname(os.path.abspath(path)) or "."
    free = shutil.disk_usage(where).free
    if needed <= free:
        return None
    return f"{what} {path} needs {_size(needed)} more, but the device holding {where} has {_size(free)} free"
