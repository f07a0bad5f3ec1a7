"""The synthetic scenes' captions: templates, spatial words from the object boxes, five per image."""

from __future__ import annotations

import numpy as np

from captioner.scenes.synthetic_drawing import Obj

_LONG_REL = {"left": "to the left of", "right": "to the right of", "above": "above", "below": "below"}
_SHORT_REL = {"left": "left of", "right": "right of", "above": "above", "below": "below"}
# Caption templates: {a} {b} {c} are noun phrases ("a red circle"), {rel}/{srel}
# the long/short relation of a to b, {pos} where a single object sits.
_TEMPLATES: dict[int, tuple[str, ...]] = {
    1: (
        "{a}",
        "a single {bare} {pos}",
        "there is {a} {pos}",
        "{a} on a {bg} background",
        "{a} {pos} of the image",
        "a {bg} background with {a}",
        "the image shows {a}",
    ),
    2: (
        "{a} {rel} {b}",
        "{a} is {srel} {b}",
        "the image shows {a} {rel} {b}",
        "there is {a} next to {b}",
        "{a} and {b}",
        "{a} and {b} on a {bg} background",
    ),
}
# Three-object scenes are described whole: every template names all three objects, so a model is never
# taught to leave one out. Nine of them: the pool's size is part of the random stream, which keeps every image.
_TRIPLE_TEMPLATES = (
    "{a}, {b} and {c}",
    "{a}, {b} and {c} on a {bg} background",
    "there is {a}, {b} and {c}",
    "the image shows {a}, {b} and {c}",
    "{a} {rel} {b}, and {c}",
    "{a} is {srel} {b}, and there is {c}",
    "{a} next to {b} and {c}",
    "{a} and {b} with {c}",
    "a {bg} background with {a}, {b} and {c}",
)


def _centre(o: Obj) -> tuple[float, float]:
    x0, y0, s = o["box"]
    return x0 + s / 2, y0 + s / 2


def _relation(a: Obj, b: Obj) -> str:
    """Where a is relative to b, on the axis with the larger centre difference."""
    (ax, ay), (bx, by) = _centre(a), _centre(b)
    if abs(ax - bx) >= abs(ay - by):
        return "left" if ax < bx else "right"
    return "above" if ay < by else "below"


def _position(o: Obj, w: int, h: int) -> str:
    cx, cy = _centre(o)
    dx, dy = cx / w - 0.5, cy / h - 0.5
    if max(abs(dx), abs(dy)) < 0.12:
        return "in the middle"
    if abs(dx) >= abs(dy):
        return "on the left" if dx < 0 else "on the right"
    return "near the top" if dy < 0 else "near the bottom"


def _phrase(o: Obj) -> str:
    """Noun phrase with article: 'a red circle', 'an orange star'."""
    article = "an" if o["color"][0] in "aeiou" else "a"
    return f"{article} {o['color']} {o['shape']}"


def captions(rng: np.random.Generator, objs: list[Obj], bg: str, w: int, h: int) -> list[str]:
    """Five captions from distinct templates, with varied case and full stop."""
    pool = _TRIPLE_TEMPLATES if len(objs) == 3 else _TEMPLATES[len(objs)]
    caps = []
    for t in rng.choice(len(pool), size=5, replace=False):
        # A fresh object order per caption: the objects are named, and related, in a random order.
        order = [objs[i] for i in rng.permutation(len(objs))]
        rel = _relation(order[0], order[1]) if len(order) > 1 else "left"
        a, b, c = ([_phrase(o) for o in order] + ["", ""])[:3]
        cap = pool[t].format(
            a=a,
            b=b,
            c=c,
            bare=f"{order[0]['color']} {order[0]['shape']}",
            rel=_LONG_REL[rel],
            srel=_SHORT_REL[rel],
            pos=_position(order[0], w, h),
            bg=bg,
        )
        if rng.random() < 0.5:
            cap = cap[0].upper() + cap[1:]
        if rng.random() < 0.5:
            cap += "."
        caps.append(cap)
    return caps
