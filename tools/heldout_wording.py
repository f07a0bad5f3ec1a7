"""The held-out scenes' captions, in their own wording (none of `synthetic_wording`'s templates)."""

from __future__ import annotations

import numpy as np


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _noun(o: dict, colour: bool) -> str:
    words = f"{o['color']} {o['shape']}" if colour else o["shape"]
    return f"{_article(words)} {words}"


def _where(o: dict, w: int, h: int) -> str:
    cx, cy = (o["x"] + o["side"] / 2) / w, (o["y"] + o["side"] / 2) / h
    col = "left" if cx < 1 / 3 else "right" if cx > 2 / 3 else ""
    row = "upper" if cy < 1 / 3 else "lower" if cy > 2 / 3 else ""
    if not col and not row:
        return "at the centre"
    if col and row:
        return f"in the {row} {col} corner"
    return f"in the {row or 'middle'} part" if row else f"on the {col} side"


def _beside(a: dict, b: dict) -> str:
    """How a stands to b, from their centres, on the axis where they differ most."""
    dx = (a["x"] + a["side"] / 2) - (b["x"] + b["side"] / 2)
    dy = (a["y"] + a["side"] / 2) - (b["y"] + b["side"] / 2)
    if abs(dx) >= abs(dy):
        return "to the left of" if dx < 0 else "to the right of"
    return "over" if dy < 0 else "under"


def captions_for(
    rng: np.random.Generator, objects: list[dict], bg_word: str, w: int, h: int, colour: bool
) -> list[str]:
    """Five captions in this generator's own wording; no colour words for grayscale files."""
    out = []
    for _ in range(5):
        objs = [objects[i] for i in rng.permutation(len(objects))]
        nouns = [_noun(o, colour) for o in objs]
        if len(objs) == 1:
            (o,), (n,) = objs, nouns
            options = [
                n,
                f"{n} {_where(o, w, h)}",
                f"a picture of {n}",
                f"one {n.split(' ', 1)[1]} on a {bg_word} background",
                f"{n} is shown {_where(o, w, h)}",
                f"just {n} and nothing else",
            ]
        elif len(objs) == 2:
            (a, b), rel = nouns, _beside(objs[0], objs[1])
            options = [
                f"{a} and {b}",
                f"{a} {rel} {b}",
                f"two shapes, {a} and {b}",
                f"{a} placed {rel} {b}",
                f"a picture with {a} and {b}",
            ]
        else:
            a, b, c = nouns
            options = [
                f"{a}, {b} and {c}",
                f"three shapes: {a}, {b} and {c}",
                f"{a} {_beside(objs[0], objs[1])} {b}, and {c}",
                f"a {bg_word} scene with {a}, {b} and {c}",
            ]
        text = options[int(rng.integers(len(options)))]
        if rng.random() < 0.4:
            text = text.capitalize()
        out.append(text + ("." if rng.random() < 0.3 else ""))
    return out
