"""Reading COCO caption annotations (through pycocotools) and Karpathy split files, checked.

Every problem in a user's files becomes a `CaptionerError` naming the file and the field or image; `skip_missing` goes
on without images whose file is absent, `skip_bad` without malformed annotations (both counted and reported).
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from pycocotools.coco import COCO

from captioner.errors import CaptionerError
from captioner.io import read_json

SPLITS = ("train", "val", "test")


@dataclass
class ImageRecord:
    """One image and its reference captions."""

    image_id: int
    path: str  # absolute path of the image file
    split: str  # train | val | test
    captions: list[str] = field(default_factory=list)


@dataclass
class Skipped:
    """What was left out, and why, for the report at the end of `prepare`."""

    missing_images: list[str] = field(default_factory=list)
    bad_annotations: list[str] = field(default_factory=list)

    def report(self) -> str:
        parts = []
        if self.missing_images:
            parts.append(f"{len(self.missing_images)} missing images skipped (e.g. {self.missing_images[0]})")
        if self.bad_annotations:
            parts.append(f"{len(self.bad_annotations)} bad annotations skipped (e.g. {self.bad_annotations[0]})")
        return "; ".join(parts)


def _require(cond: bool, path: str, where: str, problem: str) -> None:
    if not cond:
        raise CaptionerError(f"{path}: {where}: {problem}")


def _check_captions_json(data, path: str, skip_bad: bool, skipped: Skipped) -> dict:
    """Validate the COCO captions layout; returns the data with bad annotations dropped."""
    layout = "expected a JSON object with 'images' and 'annotations' (COCO captions format)"
    _require(isinstance(data, dict), path, "top level", layout)
    for key in ("images", "annotations"):
        _require(key in data, path, "top level", f"missing the '{key}' field")
        _require(isinstance(data[key], list), path, f"'{key}'", "must be a list")
    seen = set()
    for i, img in enumerate(data["images"]):
        where = f"images[{i}]"
        _require(isinstance(img, dict), path, where, "must be an object")
        for k, typ in (("id", int), ("file_name", str)):
            _require(k in img, path, where, f"missing the '{k}' field")
            _require(
                isinstance(img[k], typ) and not isinstance(img[k], bool),
                path,
                f"{where}.{k}",
                f"must be {typ.__name__}, got {type(img[k]).__name__}",
            )
        _require(img["id"] not in seen, path, f"{where}.id", f"duplicate image id {img['id']}")
        seen.add(img["id"])
    good, ann_ids = [], set()
    for i, ann in enumerate(data["annotations"]):
        where = f"annotations[{i}]"
        problem = None
        if not isinstance(ann, dict):
            problem = "must be an object"
        elif "image_id" not in ann or "caption" not in ann:
            problem = "missing the 'image_id' or 'caption' field"
        elif not isinstance(ann["caption"], str):
            problem = f"caption must be a string, got {type(ann['caption']).__name__}"
        elif not ann["caption"].strip():
            problem = "the caption is empty"
        elif ann["image_id"] not in seen:
            problem = f"image_id {ann['image_id']!r} is not in 'images'"
        elif "id" in ann and ann["id"] in ann_ids:
            problem = f"duplicate annotation id {ann['id']}"
        if problem:
            if not skip_bad:
                raise CaptionerError(f"{path}: {where}: {problem} (--skip-bad skips such annotations)")
            skipped.bad_annotations.append(f"{os.path.basename(path)} {where}: {problem}")
            continue
        ann_ids.add(ann.get("id"))
        good.append(ann)
    return {"images": data["images"], "annotations": good}


def _load_coco(path: str, skip_bad: bool, skipped: Skipped) -> COCO:
    data = _check_captions_json(read_json(path, "COCO captions"), path, skip_bad, skipped)
    # Annotation ids are optional in our check but pycocotools indexes by them.
    for k, ann in enumerate(data["annotations"]):
        ann.setdefault("id", -(k + 1))
    coco = COCO()
    coco.dataset = data
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints progress
        coco.createIndex()
    return coco


def _karpathy_splits(path: str) -> dict[int, str]:
    """image id → split from a Karpathy `dataset_coco.json`; restval counts as train."""
    data = read_json(path, "Karpathy split")
    layout = "expected {'images': [...]} (Karpathy dataset_coco.json layout)"
    _require(isinstance(data, dict) and isinstance(data.get("images"), list), path, "top level", layout)
    splits = {}
    for i, img in enumerate(data["images"]):
        where = f"images[{i}]"
        _require(isinstance(img, dict), path, where, "must be an object")
        key = "cocoid" if "cocoid" in img else "imgid" if "imgid" in img else None
        _require(key is not None, path, where, "missing the 'cocoid' field")
        _require(
            img.get("split") in ("train", "restval", "val", "test"),
            path,
            f"{where}.split",
            f"must be train, restval, val or test, got {img.get('split')!r}",
        )
        splits[img[key]] = "train" if img["split"] == "restval" else img["split"]
    return splits


def default_splits(image_ids: Sequence[int], seed: int = 0) -> dict[int, str]:
    """A deterministic split: 5% val and 5% test (1 to 5000 each), the rest train."""
    ids = sorted(image_ids)
    order = np.random.RandomState(seed).permutation(len(ids))
    n_held = min(5000, max(1, round(0.05 * len(ids)))) if len(ids) >= 3 else 0
    splits = {}
    for rank, j in enumerate(order):
        splits[ids[j]] = "val" if rank < n_held else "test" if rank < 2 * n_held else "train"
    return splits


def _find_image(file_name: str, image_dirs: Sequence[str]) -> str | None:
    for d in image_dirs:
        for candidate in (os.path.join(d, file_name), os.path.join(d, os.path.basename(file_name))):
            if os.path.isfile(candidate):
                return os.path.abspath(candidate)
    return None


def _read_captions(
    captions: Sequence[str], skip_bad: bool, skipped: Skipped
) -> tuple[dict[int, ImageRecord], dict[int, str]]:
    """Every image of the caption files with its captions (no split yet), and the file naming each."""
    records: dict[int, ImageRecord] = {}
    sources: dict[int, str] = {}
    for path in captions:
        coco = _load_coco(path, skip_bad, skipped)
        for image_id, img in coco.imgs.items():
            if image_id in records:
                raise CaptionerError(f"{path}: image id {image_id} is also in {sources[image_id]}")
            sources[image_id] = path
            caps = [a["caption"].strip() for a in coco.imgToAnns.get(image_id, [])]
            records[image_id] = ImageRecord(image_id, img["file_name"], "", caps)
    return records, sources


def _split(records: dict[int, ImageRecord], splits_path: str | None) -> tuple[dict[int, ImageRecord], dict[int, str]]:
    """The records a split file lists (all without one) and each one's split."""
    if not splits_path:
        return records, default_splits(list(records))
    splits = _karpathy_splits(splits_path)
    unknown = [i for i in splits if i not in records]
    if unknown:
        raise CaptionerError(
            f"{splits_path}: {len(unknown)} images are not in the caption files "
            f"(e.g. id {unknown[0]}); pass every --captions file the split uses"
        )
    return {i: r for i, r in records.items() if i in splits}, splits


def load_dataset(
    captions: Sequence[str],
    image_dirs: Sequence[str],
    splits_path: str | None = None,
    *,
    skip_missing: bool = False,
    skip_bad: bool = False,
) -> tuple[list[ImageRecord], Skipped]:
    """Read one or more COCO caption files and pair each image with its file (found in the first of
    `image_dirs` that holds it) and split: the records sorted by image id, and what was skipped.

    A Karpathy split file (`splits_path`) leaves out the images it does not list. Raises `CaptionerError`
    when a file is malformed, an image is missing (without `skip_missing`) or none is usable.
    """
    for d in image_dirs:
        if not os.path.isdir(d):
            raise CaptionerError(f"--images {d}: no such directory")
    skipped = Skipped()
    records, sources = _read_captions(captions, skip_bad, skipped)
    records, splits = _split(records, splits_path)
    out = []
    for image_id in sorted(records):
        rec = records[image_id]
        if not rec.captions:
            continue  # an image nobody described teaches nothing and cannot be scored
        found = _find_image(rec.path, image_dirs)
        if found is None:
            if not skip_missing:
                raise CaptionerError(
                    f"image {rec.path} (id {image_id}, listed in {sources[image_id]}) "
                    f"is not in {', '.join(image_dirs)}; --skip-missing goes on without it"
                )
            skipped.missing_images.append(rec.path)
            continue
        rec.path, rec.split = found, splits[image_id]
        out.append(rec)
    if not out:
        raise CaptionerError(
            f"no usable images: none of the captioned images in {', '.join(captions)} "
            f"were found in {', '.join(image_dirs)}"
        )
    return out, skipped
