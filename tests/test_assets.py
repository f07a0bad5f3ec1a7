"""The bundled demo model and its examples: what they say of themselves is true, and names no path of
the machine that built them."""

from __future__ import annotations

import json
import re

from conftest import REPO

ASSETS = REPO / "captioner" / "assets"
MACHINE_PATH = re.compile(r"(?<![\w.])(/(tmp|home|work|root|Users|var|opt|mnt|srv|data)/|[A-Za-z]:\\\\)")


def test_no_file_of_the_bundled_model_names_a_path_of_the_machine_it_was_built_on():
    found = []
    for path in sorted(ASSETS.rglob("*")):
        if path.suffix in (".json", ".md", ".txt"):
            for k, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                found += [f"{path.relative_to(REPO)}:{k}: {m.group(0)}" for m in MACHINE_PATH.finditer(line)]
    assert not found, found


def test_the_card_says_how_it_was_made_and_how_it_does_on_its_examples():
    card = json.loads((ASSETS / "demo" / "config.json").read_text())["card"]
    assert card["rebuild"].startswith("python -m tools.build_demo ") and card["commit"]
    examples = {e["file"]: e for e in card["examples"]}
    assert set(examples) == {p.name for p in (ASSETS / "examples").iterdir()}
    assert all(isinstance(e["correct"], bool) for e in examples.values())
    for key in ("scene_accuracy", "scene_accuracy_by_objects", "test_metrics", "attention_health", "built_on"):
        assert key in card, key
    assert {"pointing", "two_objects", "BLEU-4", "CIDEr"} <= set(card["test_metrics"])
