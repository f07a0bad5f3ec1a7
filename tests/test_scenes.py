"""Judging captions of synthetic scenes object by object, and how the demo's examples and decoding are chosen."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest

from captioner.models.checkpoint import load_checkpoint
from captioner.models.vocab import tokenize
from tools import build_demo
from tools.demo_examples import draw_examples
from tools.judge import accuracy, judge, read_objects
from tools.scene_runs import finished


def test_wrong_shape_and_colour_are_caught_where_bleu_would_not():
    truth = [("orange", "circle"), ("yellow", "star")]
    verdict = judge(["an", "orange", "square", "and", "a", "white", "star"], truth)
    assert not verdict["correct"]
    assert verdict["wrong"] == ["an orange square", "a white star"]
    assert verdict["missing"] == ["an orange circle", "a yellow star"]
    assert verdict["objects"] == "an orange circle, a yellow star"


def test_order_and_wording_do_not_matter_but_a_left_out_object_does():
    truth = [("red", "circle"), ("blue", "square"), ("red", "circle")]
    assert judge(["a", "blue", "square", "is", "left", "of", "a", "red", "circle", "and", "a", "red", "circle"], truth)[
        "correct"
    ]
    left_out = judge(["a", "red", "circle", "to", "the", "left", "of", "a", "blue", "square"], truth)
    assert not left_out["correct"] and left_out["missing"] == ["a red circle"] and left_out["wrong"] == []
    assert not judge(["a", "red", "circle", "a", "blue", "square", "a", "red", "circle", "a", "red", "circle"], truth)[
        "correct"
    ]  # one extra


def test_the_generators_own_captions_are_judged_right(scenes):
    objects = read_objects(str(scenes / "boxes.json"))
    captions = json.loads((scenes / "captions.json").read_text())["annotations"]
    by_image: dict[int, list[bool]] = {}
    for a in captions:
        by_image.setdefault(a["image_id"], []).append(judge(tokenize(a["caption"]), objects[a["image_id"]])["correct"])
    for image_id, verdicts in by_image.items():
        # Scenes of one or two objects: every caption names them all; of three, some captions name two.
        assert all(verdicts) if len(objects[image_id]) < 3 else any(verdicts), (image_id, verdicts)
    first = {a["image_id"]: tokenize(a["caption"]) for a in captions}
    assert 0.5 < accuracy(first, objects) <= 1.0


def test_examples_are_the_first_scenes_of_their_fixed_seed(tmp_path):
    paths, objects = draw_examples(6, str(tmp_path / "a"))
    again, _ = draw_examples(6, str(tmp_path / "b"))
    assert len(paths) == 6 and set(objects) == set(paths) and all(objects[i] for i in paths)
    assert [os.path.basename(p) for p in paths.values()] == [os.path.basename(p) for p in again.values()]
    assert all(open(p, "rb").read() == open(q, "rb").read() for p, q in zip(paths.values(), again.values()))


def test_build_reuses_only_stages_that_ran_to_their_end(tmp_path):
    def run(name, events, best=True):
        d = tmp_path / name
        d.mkdir()
        (d / "metrics.jsonl").write_text("".join(json.dumps({"event": e}) + "\n" for e in events))
        if best:
            (d / "best.pt").write_bytes(b"x")
        return str(d)

    assert finished(run("done", ["start", "val", "end"]))
    assert finished(run("resumed", ["start", "stopped", "end", "start", "val", "end"]))
    assert not finished(run("stopped", ["start", "val", "stopped", "end"]))
    assert not finished(run("crashed", ["start", "val"]))
    assert not finished(run("no_best", ["start", "val", "end"], best=False))
    assert not finished(str(tmp_path / "absent"))


@pytest.mark.slow  # evaluates a trained model once per sharpness
def test_build_picks_decoding_sharpness_on_the_validation_scenes(small_run, data_dir, scenes, tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(small_run / "best.pt", run / "best.pt")
    boxes = str(scenes / "boxes.json")
    objects = read_objects(boxes)
    before = load_checkpoint(str(run / "best.pt"))["decoder"]["decode_sharpness"]
    monkeypatch.setattr(build_demo, "MIN_POINTING", 0.0)  # every k qualifies: the most scenes right wins
    path, how = build_demo.choose_sharpness(str(run / "best.pt"), str(data_dir), boxes, objects, "cpu")
    chosen = load_checkpoint(path)["decoder"]["decode_sharpness"]
    right = {}
    for k in build_demo.SHARPNESS:
        assert f"k = {k:g}: " in how
        right[k] = float(re.search(rf"k = {k:g}: ([\d.]+)% right", how).group(1))
    assert right[chosen] == max(right.values())
    assert load_checkpoint(str(run / "best.pt"))["decoder"]["decode_sharpness"] == before  # the run's file as it was
    monkeypatch.setattr(build_demo, "MIN_POINTING", 2.0)  # none qualifies: the most scenes right of all
    path, _ = build_demo.choose_sharpness(str(run / "best.pt"), str(data_dir), boxes, objects, "cpu")
    assert load_checkpoint(path)["decoder"]["decode_sharpness"] == chosen
