"""Does attention look at what the word names? Pointing accuracy against object boxes.

For each generated word that names an object present in the image, a hit is when the peak of
that word's attention map (as drawn: upsampled and smoothed by half a grid cell, see `peak`)
lies inside a box of such an object. Chance is the share of the encoder's view those boxes cover: what a
peak dropped at random would score. Boxes come from a COCO instances file read with
pycocotools: real COCO (`instances_val2014.json`, caption words mapped to categories by
`SYNONYMS`) or the synthetic scenes' `boxes.json` (shape categories plus a `color` field).
"""
from __future__ import annotations

import contextlib
import io
from collections import defaultdict
from collections.abc import Mapping

import numpy as np
from pycocotools.coco import COCO

from .coco import read_json
from .errors import CaptionerError
from .images import Preprocess
from .viz import upsample

# Caption word → COCO category name, for the words people use instead of the category name.
SYNONYMS = {
    **dict.fromkeys(["man", "men", "woman", "women", "person", "people", "persons", "boy", "boys", "girl",
                     "girls", "child", "children", "kid", "kids", "guy", "guys", "lady", "ladies", "player",
                     "players", "skier", "skiers", "surfer", "surfers", "skateboarder", "rider", "baby",
                     "adult", "adults", "gentleman", "toddler"], "person"),
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
        if not isinstance(data, dict) or not all(isinstance(data.get(k), list)
                                                 for k in ("images", "annotations", "categories")):
            raise CaptionerError(f"{path}: expected a COCO instances file with 'images', "
                                 "'annotations' and 'categories' lists")
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

    def names_object(self, word: str) -> bool:
        return word in self.colors or bool(self.category_of_word.get(word))

    def boxes_for(self, image_id: int, word: str) -> list[list[float]]:
        """Boxes [x, y, w, h] of the objects in an image that `word` names."""
        cats = self.category_of_word.get(word, set())
        return [a["bbox"] for a in self.coco.imgToAnns.get(image_id, [])
                if a["category_id"] in cats or a.get("color") == word]


def _covered_share(boxes, grid_box, size) -> float:
    """Share of the encoder's view (grid_box) covered by the union of boxes."""
    W, H = size
    mask = np.zeros((H, W), dtype=bool)
    for x, y, w, h in boxes:
        mask[max(0, int(y)):int(np.ceil(y + h)), max(0, int(x)):int(np.ceil(x + w))] = True
    l, t, r, b = (int(round(v)) for v in grid_box)
    view = mask[max(0, t):b, max(0, l):r]
    return float(view.mean()) if view.size else 0.0


def peak(attention: np.ndarray, cells: int = 4) -> tuple[float, float]:
    """Where one word's map peaks, as fractions (x, y) of the region the grid covers.

    The peak of the map as the figures draw it (`viz.upsample`: bilinear, smoothed by half a
    cell), at `cells` pixels per grid cell: a cluster of strong cells outweighs one stray cell.
    """
    g = attention.shape[-1]
    side = cells * g
    m = upsample(attention, (side, side))
    y, x = np.unravel_index(int(np.argmax(m)), m.shape)
    return (x + 0.5) / side, (y + 0.5) / side


def pointing_accuracy(captions: Mapping[int, tuple[list[str], np.ndarray]], boxes: GroundingBoxes,
                      preprocess: Preprocess = Preprocess()) -> dict:
    """Pointing accuracy of generated words, by word and by kind, and the look-ahead rate.

    Args:
        captions: image id → (words, attention (len(words), g, g)).
        boxes: the object boxes.
        preprocess: how images were fed to the encoder (which part the grid covers).

    Returns:
        {"pointing": hit rate, "chance": mean box share, "words": words scored,
         "unmatched": object words with no such object in the image, "by_word": {word: [hits, n]},
         "by_kind": {"colour" | "category": hit rate}, "lookahead": share of words whose peak
         lies on the object named by the next object word after them, "lookahead_words": how many
         words that was measured on}
    """
    hits, chances, unmatched = [], [], 0
    by_word: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    by_kind: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    ahead: list[bool] = []
    for image_id, (words, attention) in captions.items():
        if image_id not in boxes:
            continue
        size = boxes.size(image_id)
        l, t, r, b = preprocess.grid_box(*size)
        points = []
        for att in attention:
            fx, fy = peak(att)
            points.append((l + fx * (r - l), t + fy * (b - t)))

        def on(k: int, found) -> bool:
            px, py = points[k]
            return any(x <= px <= x + w and y <= py <= y + h for x, y, w, h in found)

        named = [boxes.boxes_for(image_id, w) if boxes.names_object(w) else None for w in words]
        for k, (word, found) in enumerate(zip(words, named)):
            nxt = next((f for f in named[k + 1:] if f), None)   # the next object word present in the image
            if nxt:
                ahead.append(on(k, nxt))
            if found is None:
                continue
            if not found:
                unmatched += 1
                continue
            hit = on(k, found)
            hits.append(hit)
            chances.append(_covered_share(found, (l, t, r, b), size))
            by_word[word][0] += int(hit)
            by_word[word][1] += 1
            kind = by_kind["colour" if word in boxes.colors else "category"]
            kind[0] += int(hit)
            kind[1] += 1
    return {"pointing": float(np.mean(hits)) if hits else None,
            "chance": float(np.mean(chances)) if chances else None,
            "words": len(hits), "unmatched": unmatched, "by_word": dict(by_word),
            "by_kind": {k: h / n for k, (h, n) in by_kind.items()},
            "lookahead": float(np.mean(ahead)) if ahead else None, "lookahead_words": len(ahead)}
