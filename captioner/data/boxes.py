"""Object boxes per image (COCO instances files), and which caption words name which objects.

Real COCO (`instances_val2014.json`, caption words mapped to categories by `SYNONYMS`) or the
synthetic scenes' `boxes.json` (shape categories plus a `color` field per object). Symbol: L cells.
"""

from __future__ import annotations

import contextlib
import io
from collections import defaultdict

import numpy as np
from pycocotools.coco import COCO

from captioner.errors import CaptionerError
from captioner.io import read_json

# Caption word → COCO category name, for the words people use instead of the category name.
SYNONYMS = {
    **dict.fromkeys(["man", "men", "woman", "women", "person", "people", "persons"], "person"),
    **dict.fromkeys(["boy", "boys", "girl", "girls", "child", "children", "kid", "kids"], "person"),
    **dict.fromkeys(["guy", "guys", "lady", "ladies", "player", "players", "skier", "skiers"], "person"),
    **dict.fromkeys(["surfer", "surfers", "skateboarder", "rider", "baby"], "person"),
    **dict.fromkeys(["adult", "adults", "gentleman", "toddler"], "person"),
    **dict.fromkeys(["bike", "bikes", "bicycles", "cyclist"], "bicycle"),
    **dict.fromkeys(["motorbike", "motorbikes", "motorcycles", "scooter"], "motorcycle"),
    **dict.fromkeys(["plane", "planes", "jet", "jets", "airplanes", "aircraft", "airliner"], "airplane"),
    **dict.fromkeys(["ship", "ships", "boats", "sailboat", "canoe", "kayak"], "boat"),
    **dict.fromkeys(["puppy", "puppies", "dogs"], "dog"),
    **dict.fromkeys(["kitten", "kitty", "cats"], "cat"),
    **dict.fromkeys(["cows", "cattle", "calf", "bull"], "cow"),
    **dict.fromkeys(["lamb", "lambs"], "sheep"),
    **dict.fromkeys(["ball", "balls", "soccer", "football"], "sports ball"),
    **dict.fromkeys(["racket", "racquet", "rackets"], "tennis racket"),
    **dict.fromkeys(["bat"], "baseball bat"),
    **dict.fromkeys(["glove", "mitt"], "baseball glove"),
    **dict.fromkeys(["sofa", "sofas", "couches"], "couch"),
    **dict.fromkeys(["table", "tables", "desk"], "dining table"),
    **dict.fromkeys(["plant", "plants"], "potted plant"),
    **dict.fromkeys(["television", "tv", "tvs", "monitor"], "tv"),
    **dict.fromkeys(["phone", "phones", "cellphone", "smartphone"], "cell phone"),
    **dict.fromkeys(["fridge", "refrigerators"], "refrigerator"),
    **dict.fromkeys(["doughnut", "doughnuts", "donuts"], "donut"),
    **dict.fromkeys(["hydrant"], "fire hydrant"),
    **dict.fromkeys(["teddy"], "teddy bear"),
    **dict.fromkeys(["glass", "wine"], "wine glass"),
    **dict.fromkeys(["hotdog", "hotdogs"], "hot dog"),
    **dict.fromkeys(["laptops", "computer"], "laptop"),
    **dict.fromkeys(["bag", "purse"], "handbag"),
    **dict.fromkeys(["luggage", "suitcases"], "suitcase"),
    **dict.fromkeys(["buses"], "bus"),
    **dict.fromkeys(["trains"], "train"),
    **dict.fromkeys(["trucks"], "truck"),
    **dict.fromkeys(["cars", "taxi"], "car"),
}


class GroundingBoxes:
    """Object boxes per image, and which caption words name which objects."""

    def __init__(self, path: str):
        data = read_json(path, "COCO instances (object boxes)")
        if not isinstance(data, dict) or not all(
            isinstance(data.get(k), list) for k in ("images", "annotations", "categories")
        ):
            raise CaptionerError(
                f"{path}: expected a COCO instances file with 'images', 'annotations' and 'categories' lists"
            )
        for i, ann in enumerate(data["annotations"]):
            bbox = ann.get("bbox") if isinstance(ann, dict) else None
            if not (isinstance(bbox, list) and len(bbox) == 4 and "image_id" in ann and "category_id" in ann):
                raise CaptionerError(f"{path}: annotations[{i}]: needs image_id, category_id and bbox [x, y, w, h]")
            ann.setdefault("id", i + 1)
        coco = COCO()
        coco.dataset = data
        with contextlib.redirect_stdout(io.StringIO()):
            coco.createIndex()
        self.coco = coco
        self.category_of_word: dict[str, set[int]] = defaultdict(set)
        names = {c["name"] for c in coco.cats.values()}
        for cat in coco.cats.values():
            name, last = cat["name"], cat["name"].split()[-1]
            # "sports ball" is named by "ball", but "hot dog" must not claim "dog".
            for word in (name, name + "s") + ((last, last + "s") if last not in names else ()):
                self.category_of_word[word].add(cat["id"])
        for word, name in SYNONYMS.items():
            self.category_of_word[word] |= {c["id"] for c in coco.cats.values() if c["name"] == name}
        self.colors = {a["color"] for a in coco.anns.values() if isinstance(a.get("color"), str)}

    def __contains__(self, image_id: int) -> bool:
        return image_id in self.coco.imgs

    def size(self, image_id: int) -> tuple[int, int]:
        img = self.coco.imgs[image_id]
        return int(img["width"]), int(img["height"])

    def names(self, word: str) -> set[tuple[str, object]]:
        """What `word` names: ("category", id) for each category it names (through the synonyms) and
        ("color", word) if it is an annotated colour; an annotation is named by a word when one of
        its `described_by` keys is among these."""
        named = {("category", c) for c in self.category_of_word.get(word, ())}
        return named | {("color", word)} if word in self.colors else named

    @staticmethod
    def described_by(ann: dict) -> tuple[tuple[str, object], ...]:
        """The keys of `names` that fit an annotation: its category and, where it has one, its colour."""
        color = ann.get("color")
        return (("category", ann["category_id"]),) + ((("color", color),) if isinstance(color, str) else ())

    def names_object(self, word: str) -> bool:
        return bool(self.names(word))

    def describe_one(self, image_id: int, words: list[str]) -> bool:
        """Whether one object of the image is named by each of `words`."""
        anns = self.coco.imgToAnns.get(image_id, [])
        return any(all(self.names(w).intersection(self.described_by(a)) for w in words) for a in anns)

    def all_boxes(self, image_id: int) -> list[list[float]]:
        """Boxes [x, y, w, h] of every object in an image."""
        return [a["bbox"] for a in self.coco.imgToAnns.get(image_id, [])]

    def boxes_for(self, image_id: int, word: str) -> list[list[float]]:
        """Boxes [x, y, w, h] of the objects in an image that `word` names."""
        named = self.names(word)
        return [a["bbox"] for a in self.coco.imgToAnns.get(image_id, []) if named.intersection(self.described_by(a))]


def grid_cells(boxes: list[list[float]], grid_box, grid: int) -> np.ndarray:
    """The grid cells (L,) bool that the boxes [x, y, w, h] cover: those whose centre lies in a box,
    or, for a box too small to hold a centre, the cell that holds the box's centre. `grid_box` is the
    region of the image, in its pixels, that the grid covers."""
    left, top, right, bottom = grid_box
    centres = (np.arange(grid) + 0.5) / grid
    cx, cy = left + centres * (right - left), top + centres * (bottom - top)  # (g,) each, in image pixels
    cells = np.zeros((grid, grid), dtype=bool)
    for x, y, w, h in boxes:
        inside = ((cy >= y) & (cy <= y + h))[:, None] & ((cx >= x) & (cx <= x + w))[None, :]
        if not inside.any():
            col = int(np.clip((x + w / 2 - left) / (right - left) * grid, 0, grid - 1))
            row = int(np.clip((y + h / 2 - top) / (bottom - top) * grid, 0, grid - 1))
            inside[row, col] = True
        cells |= inside
    return cells.reshape(-1)


class BoxTargets:
    """Where the object words of the training images' captions should look: the grid cells of the
    objects they name. A mask per (image, word) lets the model's own words find their cells by lookup;
    the (step, mask) pairs of each dataset caption are listed, so that a batch's targets are a slice."""

    def __init__(self, data, boxes: GroundingBoxes, preprocess, grid: int):
        ids = data.meta["image_ids"]
        train_rows = {int(r) for r in data.split_images("train")[1]}
        naming = _words_naming(boxes, data.vocab.words)
        masks: list[np.ndarray] = []
        self.index: dict[tuple[int, int], int] = {}  # (feature row, word id) → row of `masks`
        for row in sorted(train_rows):
            image_id = int(ids[row])
            if image_id not in boxes:
                continue
            anns = boxes.coco.imgToAnns.get(image_id, [])
            found: dict[int, list[int]] = defaultdict(list)  # word → the annotations it names
            for k, ann in enumerate(anns):
                for word in (w for key in boxes.described_by(ann) for w in naming.get(key, ())):
                    found[word].append(k)
            size, made = boxes.size(image_id), {}
            for word, named in found.items():  # words naming the same objects (synonyms) share one mask
                if tuple(named) not in made:
                    made[tuple(named)] = len(masks)
                    masks.append(grid_cells([anns[k]["bbox"] for k in named], preprocess.grid_box(*size), grid))
                self.index[row, word] = made[tuple(named)]
        self.masks = np.stack(masks) if masks else np.zeros((0, grid * grid), dtype=bool)  # (M, L)
        self.names_object = np.zeros(len(data.vocab), dtype=bool)  # (V,) words that name some category or colour
        self.names_object[[w for words in naming.values() for w in words]] = True
        self._list_steps(data)

    @classmethod
    def of_cells(cls, data, cells: dict[tuple[int, int], np.ndarray]) -> BoxTargets:
        """Targets given as the cells (L,) bool each (training feature row, word id) should look at."""
        targets = cls.__new__(cls)
        targets.index = {key: m for m, key in enumerate(cells)}
        empty = np.zeros((0, data.encoder.grid**2), dtype=bool)
        targets.masks = np.stack(list(cells.values())) if cells else empty
        targets.names_object = np.zeros(len(data.vocab), dtype=bool)
        targets.names_object[[word for _, word in cells]] = True
        targets._list_steps(data)
        return targets

    def _list_steps(self, data) -> None:
        """The (caption, step, mask) of each dataset caption's word with a target, in caption order."""
        caption, steps, which = [], [], []
        for c, (row, tokens, length) in enumerate(zip(data.rows, data.tokens, data.lengths)):
            for p in range(1, int(length) - 1):  # the words; α at step p-1 produced word p
                m = self.index.get((int(row), int(tokens[p])))
                if m is not None:
                    caption.append(c), steps.append(p - 1), which.append(m)
        self.caption, self.steps, self.which = (np.asarray(x, dtype=np.int64) for x in (caption, steps, which))
        self.words = len(self.caption)
        self.rows = data.rows  # (C,) each dataset caption's feature row

    def mask_of(self, row: int, word: int) -> np.ndarray | None:
        """The cells (L,) bool of the objects `word` names in the image of feature row `row`; None when
        it names none there (or the image has no targets: --boxes marks the training images, --word-maps the
        training and validation ones)."""
        m = self.index.get((row, word))
        return None if m is None else self.masks[m]

    def masks_for_predictions(self, images: np.ndarray, predicted: np.ndarray, real: np.ndarray) -> np.ndarray:
        """The cells (B, T-1, L) bool that the words a model predicts at each step (B, T-1) should
        look at, for captions of the images of feature rows `images` (B,), at the real steps
        `real` (B, T-1); empty where the word names no object of the image."""
        masks = np.zeros((*predicted.shape, self.masks.shape[1]), dtype=bool)
        places, steps = np.nonzero(real & self.names_object[predicted])
        for b, t in zip(places, steps):
            m = self.index.get((int(images[b]), int(predicted[b, t])))
            if m is not None:
                masks[b, t] = self.masks[m]
        return masks

    def for_captions(self, idx: np.ndarray, steps: int) -> tuple[np.ndarray, np.ndarray]:
        """The cells (len(idx), steps, L) bool that each step of captions `idx` (a batch, in order;
        -1 a padding row) should look at, empty at steps whose word names no boxed object; and each
        caption's feature row (len(idx),) int64, 0 on padding rows."""
        masks = np.zeros((len(idx), steps, self.masks.shape[1]), dtype=bool)
        starts = np.searchsorted(self.caption, idx, side="left")  # the entries are in caption order
        ends = np.searchsorted(self.caption, idx, side="right")
        for b, (a, e) in enumerate(zip(starts, ends)):
            masks[b, self.steps[a:e]] = self.masks[self.which[a:e]]
        return masks, np.where(idx >= 0, self.rows[idx], 0).astype(np.int64)


def _words_naming(boxes: GroundingBoxes, vocabulary: list[str]) -> dict[tuple[str, object], tuple[int, ...]]:
    """Each key of `GroundingBoxes.names` → the ids of the vocabulary's words that name it."""
    naming: dict[tuple[str, object], list[int]] = defaultdict(list)
    for word_id, word in enumerate(vocabulary):
        for key in boxes.names(word):
            naming[key].append(word_id)
    return {k: tuple(v) for k, v in naming.items()}
