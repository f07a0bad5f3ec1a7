"""Does attention look at what the word names? Pointing accuracy against object boxes.

For each generated word that names an object present in the image, a hit is when the peak of
that word's attention map (as drawn) lies inside a box of such an object. Chance is the share of
the encoder's view those boxes cover: what a peak dropped at random would score.
Symbols: g grid side.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import groupby

import numpy as np

from captioner.data.boxes import GroundingBoxes
from captioner.evaluation.maps import upsample
from captioner.models.preprocess import Preprocess


def _covered_share(boxes, grid_box, size) -> float:
    """Share of the encoder's view (grid_box) covered by the union of boxes."""
    W, H = size
    mask = np.zeros((H, W), dtype=bool)
    for x, y, w, h in boxes:
        mask[max(0, int(y)) : int(np.ceil(y + h)), max(0, int(x)) : int(np.ceil(x + w))] = True
    l, t, r, b = (int(round(v)) for v in grid_box)
    view = mask[max(0, t) : b, max(0, l) : r]
    return float(view.mean()) if view.size else 0.0


def peak(attention: np.ndarray, cells: int = 4) -> tuple[float, float]:
    """Where one word's map peaks, as fractions (x, y) of the region the grid covers: the peak of the
    map as the figures draw it (smoothed), so that a cluster of strong cells outweighs one stray cell."""
    g = attention.shape[-1]
    side = cells * g
    m = upsample(attention, (side, side))
    y, x = np.unravel_index(int(np.argmax(m)), m.shape)
    return (x + 0.5) / side, (y + 0.5) / side


def pointing_accuracy(
    captions: Mapping[int, tuple[list[str], np.ndarray]], boxes: GroundingBoxes, preprocess: Preprocess | None = None
) -> dict:
    """Pointing accuracy of generated words, by word and by kind, and the look-ahead rate.

    `captions`: image id → (words, attention (len(words), g, g)). Beside the hit rate and its chance,
    "lookahead" is the share of words whose peak lies on the object the next object word names, and
    "two_objects", of the captions naming two objects whose boxes share none, the share in which some
    word's map peaks on each.
    """
    preprocess = preprocess or Preprocess()
    tally = _Tally()
    for image_id, (words, attention) in captions.items():
        if image_id in boxes:
            _score_caption(tally, image_id, words, attention, boxes, preprocess)
    return _summary(tally)


@dataclass
class _Tally:
    """What `pointing_accuracy` counts, caption by caption."""

    hits: list[bool] = field(default_factory=list)  # per scored word: its peak on its object
    right: list[bool] = field(default_factory=list)  # per scored word: its phrase describes an object of the image
    chances: list[float] = field(default_factory=list)  # per scored word: its objects' share of the view
    unmatched: int = 0  # object words with no such object in the image
    on_another: int = 0  # scored words whose peak missed their object but lies on another
    by_word: dict[str, list[int]] = field(default_factory=lambda: defaultdict(lambda: [0, 0]))  # [hits, n]
    by_kind: dict[str, list[int]] = field(default_factory=lambda: defaultdict(lambda: [0, 0]))
    ahead: list[bool] = field(default_factory=list)  # per word: its peak on the next object named
    both: list[bool] = field(default_factory=list)  # per caption naming two objects: both reached


def _score_caption(
    tally: _Tally, image_id: int, words: list[str], attention: np.ndarray, boxes: GroundingBoxes, preprocess: Preprocess
) -> None:
    size = boxes.size(image_id)
    l, t, r, b = preprocess.grid_box(*size)
    points = _peaks_in_pixels(attention, (l, t, r, b))

    def on(k: int, found) -> bool:
        px, py = points[k]
        return any(x <= px <= x + w and y <= py <= y + h for x, y, w, h in found)

    named = [boxes.boxes_for(image_id, w) if boxes.names_object(w) else None for w in words]
    right = _right_phrases(image_id, words, named, boxes)
    objects, reached = [], []  # the box sets the caption names, and those a word's map peaked on
    for k, (word, found) in enumerate(zip(words, named)):
        nxt = next((f for f in named[k + 1 :] if f), None)  # the next object word present in the image
        if nxt:
            tally.ahead.append(on(k, nxt))
        if found is None:
            continue
        if not found:
            tally.unmatched += 1
            continue
        hit = on(k, found)
        objects.append(found)
        if hit:
            reached.append(found)
        elif on(k, boxes.all_boxes(image_id)):
            tally.on_another += 1
        tally.hits.append(hit)
        tally.right.append(right[k])
        tally.chances.append(_covered_share(found, (l, t, r, b), size))
        tally.by_word[word][0] += int(hit)
        tally.by_word[word][1] += 1
        kind = tally.by_kind["colour" if word in boxes.colors else "category"]
        kind[0] += int(hit)
        kind[1] += 1
    if _two_apart(objects):
        tally.both.append(_two_apart(reached))


def _right_phrases(image_id: int, words: list[str], named: list, boxes: GroundingBoxes) -> list[bool]:
    """Per word: whether its phrase (the run of object words it is in; `named[k]` is None for a word that names no
    object) describes one object of the image, as "red square" does a red square; "red" and "square" of a red circle
    and a blue square are both in a wrong phrase."""
    right = [False] * len(words)
    for names_object, run in groupby(range(len(words)), key=lambda k: named[k] is not None):
        run = list(run)
        if names_object:
            right[run[0] : run[-1] + 1] = [boxes.describe_one(image_id, [words[k] for k in run])] * len(run)
    return right


def _peaks_in_pixels(attention: np.ndarray, grid_box) -> list[tuple[float, float]]:
    """Each word's map peak, in image pixels."""
    l, t, r, b = grid_box
    return [(l + fx * (r - l), t + fy * (b - t)) for fx, fy in map(peak, attention)]


def _summary(tally: _Tally) -> dict:
    hits, on_another, ahead, both = tally.hits, tally.on_another, tally.ahead, tally.both
    missed = len(hits) - sum(hits)
    on_right = [hit for hit, right in zip(hits, tally.right) if right]
    return {
        "pointing": float(np.mean(hits)) if hits else None,
        # The words the caption got right: a map can only be as right as the word it is drawn for.
        "pointing_right_phrases": float(np.mean(on_right)) if on_right else None,
        "right_phrase_words": len(on_right),
        "chance": float(np.mean(tally.chances)) if tally.chances else None,
        "words": len(hits),
        "unmatched": tally.unmatched,
        "missed_on_another_object": on_another / len(hits) if hits else None,
        "missed_on_no_object": (missed - on_another) / len(hits) if hits else None,
        "by_word": dict(tally.by_word),
        "by_kind": {k: h / n for k, (h, n) in tally.by_kind.items()},
        "lookahead": float(np.mean(ahead)) if ahead else None,
        "lookahead_words": len(ahead),
        "two_objects": float(np.mean(both)) if both else None,
        "two_object_captions": len(both),
    }


def _two_apart(box_sets: list[list[list[float]]]) -> bool:
    """Whether two of the box sets share no box: two separate objects (a colour word may name both)."""
    sets = [{tuple(b) for b in found} for found in box_sets]
    return any(not (a & b) for i, a in enumerate(sets) for b in sets[i + 1 :])
