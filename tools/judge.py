"""Is a caption of a synthetic scene right? It must name every object, with its colour and shape.

BLEU and CIDEr reward captions that share words with the references, so "an orange square and
a white star" scores well on a scene of an orange circle and a yellow star. For the package's
scenes the truth is known object by object (`boxes.json`: a shape category and a "color" per
object), so a caption can be judged exactly: the (colour, shape) pairs it names, a colour word
directly followed by a shape word, must be the scene's objects, no more and no fewer.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from captioner.errors import CaptionerError
from captioner.io import read_json
from captioner.scenes.synthetic_drawing import COLORS, SHAPES

# Words a caption may name objects with; a scene's own colours and shapes are added to these.
KNOWN_COLOURS, KNOWN_SHAPES = frozenset(COLORS), frozenset(SHAPES)
Thing = tuple[str, str]  # (colour, shape)


def _phrase(thing: Thing) -> str:
    colour, shape = thing
    return f"{'an' if colour[0] in 'aeiou' else 'a'} {colour} {shape}"


def read_objects(boxes_path: str) -> dict[int, list[Thing]]:
    """Image id → its objects as (colour, shape), from a synthetic set's boxes.json."""
    data = read_json(boxes_path, "object boxes")
    try:
        shapes = {c["id"]: c["name"] for c in data["categories"]}
        objects: dict[int, list[Thing]] = {int(im["id"]): [] for im in data["images"]}
        for a in data["annotations"]:
            objects[int(a["image_id"])].append((a["color"], shapes[a["category_id"]]))
    except (KeyError, TypeError) as e:
        raise CaptionerError(f"{boxes_path}: not a synthetic scenes' boxes file with colours ({e!r})") from None
    return objects


def named_objects(words: Sequence[str], colours: Iterable[str], shapes: Iterable[str]) -> list[Thing]:
    """The (colour, shape) pairs a caption names: a colour word directly followed by a shape word."""
    colours, shapes = set(colours), set(shapes)
    return [(a, b) for a, b in zip(words, words[1:]) if a in colours and b in shapes]


def judge(words: Sequence[str], objects: Sequence[Thing]) -> dict:
    """How a caption describes a scene.

    Args:
        words: the caption's words.
        objects: the scene's objects as (colour, shape).

    Returns:
        {"correct": bool, "wrong": phrases named but not in the scene, "missing": objects not named,
         "objects": the scene's objects as one phrase}
    """
    colours = {c for c, _ in objects} | KNOWN_COLOURS
    shapes = {s for _, s in objects} | KNOWN_SHAPES
    named, truth = Counter(named_objects(words, colours, shapes)), Counter(objects)
    wrong, missing = named - truth, truth - named
    return {
        "correct": not wrong and not missing,
        "wrong": [_phrase(t) for t in sorted(wrong.elements())],
        "missing": [_phrase(t) for t in sorted(missing.elements())],
        "objects": ", ".join(_phrase(t) for t in objects),
    }


def accuracy(captions: Mapping[int, Sequence[str]], objects: Mapping[int, Sequence[Thing]]) -> float | None:
    """Share of captions (image id → words) that name exactly their scene's objects."""
    judged = [judge(words, objects[i])["correct"] for i, words in captions.items() if i in objects]
    return sum(judged) / len(judged) if judged else None
