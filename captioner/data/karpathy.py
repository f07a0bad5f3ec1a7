"""Reading Karpathy's `dataset_coco.json` / `dataset_flickr8k.json` / `dataset_flickr30k.json` alone.

These files carry images, their captions and the split together:

    {"dataset": "flickr8k", "images": [{"filename": "1000268201_693b08cb0e.jpg", "imgid": 0,
      "split": "train", "sentences": [{"raw": "A child in a pink dress ...", "tokens": [...]}, ...]},
     ...]}

COCO's file adds `filepath` ("train2014" / "val2014") and `cocoid` (COCO's image id). The image is DIR/filepath/filename
(or DIR/filename: then the train2014 and val2014 directories can be given as two --images directories); the id is
`cocoid` when present, `imgid` otherwise; `restval` counts as train.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from captioner.data.coco import ImageRecord, Skipped
from captioner.errors import CaptionerError
from captioner.io import read_json

KARPATHY_SPLITS = {"train": "train", "restval": "train", "val": "val", "test": "test"}


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _sentence_text(sentence, where: str) -> tuple[str | None, str | None]:
    """(caption text, None) or (None, what is wrong with the sentence)."""
    if not isinstance(sentence, dict):
        return None, f"{where}: must be an object"
    if "raw" in sentence:
        raw = sentence["raw"]
        if not isinstance(raw, str):
            return None, f"{where}.raw: must be a string, got {type(raw).__name__}"
        text = raw.strip()
    elif "tokens" in sentence:
        tokens = sentence["tokens"]
        if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
            return None, f"{where}.tokens: must be a list of strings"
        text = " ".join(tokens).strip()
    else:
        return None, f"{where}: missing the 'raw' field (and no 'tokens' either)"
    if not text:
        return None, f"{where}: the caption is empty"
    return text, None


def _image_file(filename: str, filepath: str | None, image_dirs: Sequence[str]) -> str | None:
    for d in image_dirs:
        candidates = [os.path.join(d, filepath, filename)] if filepath else []
        for candidate in (*candidates, os.path.join(d, filename)):
            if os.path.isfile(candidate):
                return os.path.abspath(candidate)
    return None


def _check_image(img, i: int, path: str, seen) -> tuple[int, str, str | None, str, str]:
    """(image id, filename, filepath, split, its name in messages) of images[i], or an error."""
    if not isinstance(img, dict):
        raise CaptionerError(f"{path}: images[{i}]: must be an object")
    name = img.get("filename")
    where = f"images[{i}]" + (f" ({name})" if isinstance(name, str) and name else "")

    def require(cond: bool, problem: str) -> None:
        if not cond:
            raise CaptionerError(f"{path}: {where}: {problem}")

    require("filename" in img, "missing the 'filename' field")
    require(isinstance(name, str) and bool(name), "'filename' must be a non-empty string")
    filepath = img.get("filepath")
    require(
        filepath is None or isinstance(filepath, str), f"'filepath' must be a string, got {type(filepath).__name__}"
    )
    key = "cocoid" if "cocoid" in img else "imgid" if "imgid" in img else None
    require(key is not None, "missing the 'cocoid' or 'imgid' field")
    image_id = img[key]
    require(_is_int(image_id), f"'{key}' must be int, got {type(image_id).__name__}")
    require(image_id not in seen, f"duplicate image id {image_id} ('{key}')")
    require("split" in img, "missing the 'split' field")
    require(img["split"] in KARPATHY_SPLITS, f"'split' must be train, restval, val or test, got {img['split']!r}")
    require("sentences" in img, "missing the 'sentences' field")
    require(isinstance(img["sentences"], list), f"'sentences' must be a list, got {type(img['sentences']).__name__}")
    return image_id, name, filepath, KARPATHY_SPLITS[img["split"]], where


def _captions(sentences: list, path: str, where: str, skip_bad: bool, skipped: Skipped) -> list[str]:
    """An image's caption texts; a malformed sentence is an error, or skipped and noted with skip_bad."""
    captions = []
    for j, sentence in enumerate(sentences):
        text, problem = _sentence_text(sentence, f"sentences[{j}]")
        if problem:
            if not skip_bad:
                raise CaptionerError(f"{path}: {where}: {problem} (--skip-bad skips such sentences)")
            skipped.bad_annotations.append(f"{os.path.basename(path)} {where}: {problem}")
            continue
        captions.append(text)
    return captions


def load_karpathy(
    path: str, image_dirs: Sequence[str], *, skip_missing: bool = False, skip_bad: bool = False
) -> tuple[list[ImageRecord], Skipped]:
    """Read a Karpathy dataset file and pair each image with its file, split and captions: the records
    sorted by image id, and what was skipped. Raises `CaptionerError` when the file is unreadable or
    malformed (the message names the image and the field), an image id repeats, or an image file is missing.
    """
    for d in image_dirs:
        if not os.path.isdir(d):
            raise CaptionerError(f"--images {d}: no such directory")
    data = read_json(path, "Karpathy dataset")
    if not (isinstance(data, dict) and isinstance(data.get("images"), list)):
        raise CaptionerError(
            f"{path}: top level: expected {{'images': [...]}} (Karpathy "
            "dataset_coco.json / dataset_flickr8k.json layout)"
        )
    skipped = Skipped()
    records: dict[int, ImageRecord] = {}
    filepaths: dict[int, str | None] = {}
    for i, img in enumerate(data["images"]):
        image_id, name, filepath, split, where = _check_image(img, i, path, records)
        captions = _captions(img["sentences"], path, where, skip_bad, skipped)
        records[image_id] = ImageRecord(image_id, name, split, captions)
        filepaths[image_id] = filepath
    out = []
    for image_id in sorted(records):
        rec = records[image_id]
        if not rec.captions:
            continue  # an image nobody described teaches nothing and cannot be scored
        found = _image_file(rec.path, filepaths[image_id], image_dirs)
        shown = os.path.join(filepaths[image_id] or "", rec.path)
        if found is None:
            if not skip_missing:
                raise CaptionerError(
                    f"image {shown} (id {image_id}, listed in {path}) is not in "
                    f"{', '.join(image_dirs)}; --skip-missing goes on without it"
                )
            skipped.missing_images.append(shown)
            continue
        out.append(ImageRecord(image_id, found, rec.split, rec.captions))
    if not out:
        raise CaptionerError(
            f"no usable images: none of the captioned images in {path} were found in {', '.join(image_dirs)}"
        )
    return out, skipped
