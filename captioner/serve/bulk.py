"""Captioning many image files: `captioner caption` on files, directories and globs.

Each result is appended to a JSON-lines log as soon as its batch is done (fsync'ed), so a killed
run keeps what it did and `--resume` skips the images already in the log.
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from captioner.data.images import load_image
from captioner.errors import CaptionerError, ImageError

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")


def _images_in(directory: str, recursive: bool) -> list[str]:
    if recursive:
        found = [os.path.join(root, f) for root, _, files in os.walk(directory) for f in files]
    else:
        found = [os.path.join(directory, f) for f in os.listdir(directory)]
    return sorted(p for p in found if p.lower().endswith(IMAGE_EXTENSIONS) and os.path.isfile(p))


def expand_inputs(specs: Sequence[str], recursive: bool = False) -> list[str]:
    """Files, directories and glob patterns → image paths (normalised), each once, in order. A file named
    on its own is taken as it is (if it is not an image, captioning says so). Raises CaptionerError for a
    directory without images, or a pattern that matches none."""
    paths: list[str] = []
    for spec in specs:
        if os.path.isdir(spec):
            found = _images_in(spec, recursive)
            if not found:
                raise CaptionerError(
                    f"{spec}: no image files in this directory ({', '.join(IMAGE_EXTENSIONS)})"
                    + ("" if recursive else "; --recursive looks in subdirectories")
                )
            paths += found
        elif not os.path.exists(spec) and re.search(r"[*?\[]", spec):
            found = sorted(
                p for p in glob.glob(spec, recursive=True) if os.path.isfile(p) and p.lower().endswith(IMAGE_EXTENSIONS)
            )
            if not found:
                raise CaptionerError(f"{spec}: the pattern matches no image files")
            paths += found
        else:
            paths.append(spec)
    # Spelled one way (./a.jpg and a.jpg are one image), so that logs and ids match across runs.
    return list(dict.fromkeys(os.path.normpath(p) for p in paths))


def image_ids(paths: Sequence[str]) -> dict[str, int | str]:
    """One image id per path, all of one type: COCO's numbers (COCO_val2014_000000391895.jpg → 391895)
    when every file name ends in a distinct number; else the distinct stems, else the paths."""
    stems = [os.path.splitext(os.path.basename(p))[0] for p in paths]
    numbers = [s.rsplit("_", 1)[-1] for s in stems]
    if all(n.isdigit() for n in numbers) and len({int(n) for n in numbers}) == len(paths):
        return {p: int(n) for p, n in zip(paths, numbers)}
    if len(set(stems)) == len(paths):
        return dict(zip(paths, stems))
    return {p: p for p in paths}


class ResultLog:
    """Results as JSON lines, one per image, appended as they are made; with `resume`, the results
    already in it are kept (their images are skipped). Raises CaptionerError when the log holds results and
    `resume` is off, or a line is not a result."""

    def __init__(self, path: str, resume: bool):
        self.path, self.done = path, {}
        if os.path.exists(path) and os.path.getsize(path) and not resume:
            raise CaptionerError(
                f"{path} already holds results; pass --resume to skip the images in it, or remove it to start again"
            )
        if resume and os.path.exists(path):
            self.done = self._read()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._file = open(path, "a", encoding="utf-8")

    def _read(self) -> dict[str, dict]:
        with open(self.path, "rb") as f:
            data = f.read()
        done, good = {}, 0  # good: bytes up to the last complete, readable line
        for line in data.split(b"\n")[:-1]:
            try:
                record = json.loads(line)
                done[record["file_name"]] = record
            except (ValueError, KeyError, TypeError):
                raise CaptionerError(
                    f"{self.path}: line {len(done) + 1} is not a result written by "
                    "`captioner caption`; remove the file to start again"
                ) from None
            good += len(line) + 1
        if good < len(data):  # a line cut off when a run was killed: drop it
            with open(self.path, "r+b") as f:
                f.truncate(good)
        return done

    def append(self, records: list[dict]) -> None:
        if records:
            self._file.write("".join(json.dumps(r) + "\n" for r in records))
            self._file.flush()
            os.fsync(self._file.fileno())
        for r in records:
            self.done[r["file_name"]] = r

    def close(self) -> None:
        self._file.close()


def decoded(paths: Sequence[str], workers: int, ahead: int) -> Iterator[tuple[str, object]]:
    """(path, upright RGB image or the ImageError that explains why not), in order; up to
    `ahead` images are decoded by `workers` threads while the caller works on earlier ones."""

    def load(path):
        try:
            return load_image(path)
        except ImageError as e:
            return e

    if workers <= 0:
        yield from ((p, load(p)) for p in paths)
        return
    with ThreadPoolExecutor(workers, thread_name_prefix="decode") as pool:
        pending = [pool.submit(load, p) for p in paths[:ahead]]
        for i, path in enumerate(paths):
            if i + ahead < len(paths):
                pending.append(pool.submit(load, paths[i + ahead]))
            yield path, pending[i].result()
            pending[i] = None  # let the image go once captioned


@dataclass
class Outcome:
    records: list[dict] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


def record(path: str, image_id: int | str, out, attention: bool) -> dict:
    """One result as JSON: COCO's image_id and caption, the file, and what was asked for; with several
    samples drawn, all of them under "samples", each as its own caption."""
    r = {"image_id": image_id, "file_name": path, **_written(out, attention)}
    if len(getattr(out, "samples", [])) > 1:
        r["samples"] = [_written(s, attention) for s in out.samples]
    familiarity = getattr(out, "familiarity", None)  # present once the model scores it
    if familiarity is not None:
        r["familiarity"] = familiarity
    return r


def _written(out, attention: bool) -> dict:
    r = {"caption": out.text, "score": round(float(out.score), 4)}
    if attention:
        r["words"] = list(out.words)
        r["attention"] = np.round(np.asarray(out.attention, dtype=np.float64), 5).tolist()  # (words, g, g)
        if out.locations is not None:
            r["locations"] = [list(map(int, rc)) for rc in out.locations]
    return r


def caption_files(
    captioner,
    paths: Sequence[str],
    ids: dict,
    *,
    batch_size: int = 8,
    workers: int = 2,
    attention: bool = False,
    log: ResultLog | None = None,
    on_result: Callable | None = None,
    on_error: Callable | None = None,
    **caption_kwargs,
) -> Outcome:
    """Caption image files in batches, decoding ahead in `workers` threads (0: in this thread).
    `on_result(path, image, caption, record)` is called after each batch is logged, `on_error(path,
    ImageError)` for an image that cannot be read; `caption_kwargs` go to `caption_batch`."""
    outcome = Outcome()
    batch: list[tuple[str, object]] = []

    def flush():
        captions = captioner.caption_batch([im for _, im in batch], batch_size=len(batch), **caption_kwargs)
        records = [record(p, ids[p], out, attention) for (p, _), out in zip(batch, captions)]
        if log is not None:
            log.append(records)
        outcome.records.extend(records)
        if on_result:
            for (p, im), out, r in zip(batch, captions, records):
                on_result(p, im, out, r)
        batch.clear()

    for path, image in decoded(paths, workers, ahead=2 * batch_size):
        if isinstance(image, ImageError):
            outcome.failed.append(path)
            if on_error:
                on_error(path, image)
            continue
        batch.append((path, image))
        if len(batch) == batch_size:
            flush()
    if batch:
        flush()
    return outcome
