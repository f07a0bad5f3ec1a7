"""`captioner caption` on many images: inputs, batches, JSON lines, resume, one id type, help."""

from __future__ import annotations

import argparse
import json
import shutil

import pytest
from conftest import run_cli

from captioner.cli import main as cli
from captioner.cli import train as train_cli
from captioner.errors import CaptionerError, OptionError
from captioner.options import from_args
from captioner.serve.bulk import expand_inputs, image_ids


@pytest.fixture(scope="module")
def folder(scenes, tmp_path_factory):
    """Five scene images in a folder, one more in a subfolder, and a text file."""
    root = tmp_path_factory.mktemp("photos")
    images = sorted((scenes / "images").iterdir())
    for p in images[:5]:
        shutil.copy(p, root / p.name)
    (root / "sub").mkdir()
    shutil.copy(images[5], root / "sub" / images[5].name)
    (root / "notes.txt").write_text("not an image")
    return root


def test_inputs_expand_from_files_directories_and_patterns(folder):
    top = sorted(str(p) for p in folder.iterdir() if p.suffix in (".jpg", ".png"))
    assert expand_inputs([str(folder)]) == top  # images only, sorted
    assert len(expand_inputs([str(folder)], recursive=True)) == 6
    assert expand_inputs([str(folder / "*.*")]) == top  # the text file is left out
    assert len(expand_inputs([str(folder / "**" / "*.*")])) == 6
    assert expand_inputs([top[0], str(folder / "." / top[0].split("/")[-1]), str(folder)]) == top  # each once
    with pytest.raises(CaptionerError, match="matches no image files"):
        expand_inputs([str(folder / "*.gif")])
    (folder / "empty").mkdir(exist_ok=True)
    with pytest.raises(CaptionerError, match="no image files"):
        expand_inputs([str(folder / "empty")])


def test_image_ids_are_one_type():
    assert image_ids(["a/COCO_val2014_000000391895.jpg", "b/7.png"]) == {
        "a/COCO_val2014_000000391895.jpg": 391895,
        "b/7.png": 7,
    }
    mixed = image_ids(["COCO_val2014_000000391895.jpg", "holiday.jpg"])
    assert set(map(type, mixed.values())) == {str}
    assert image_ids(["x/1.jpg", "y/1.jpg"]) == {"x/1.jpg": "x/1.jpg", "y/1.jpg": "y/1.jpg"}  # same number


def _subcommands(parser):
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_every_option_has_help():
    for parser in (cli.get_parser(), train_cli.get_parser()):
        for name, sub in _subcommands(parser).items():
            for action in sub._actions:
                assert action.help and action.help.strip(), (name, action.dest)
    caption = _subcommands(cli.get_parser())["caption"]
    assert next(a for a in caption._actions if a.dest == "checkpoint").default is None  # the bundled model


def test_folder_in_batches_with_attention_resume_and_one_id_type(small_run, folder, tmp_path, capsys):
    bad = tmp_path / "broken.jpg"
    bad.write_bytes(b"\xff\xd8 not really")
    out = tmp_path / "res.json"
    common = ["--checkpoint", str(small_run / "best.pt"), "--json", str(out), "--batch-size", "2", "--beam-size", "2"]
    args = ["caption", str(folder), str(bad), *common, "--attention"]
    assert cli.main(args) == 2  # one image failed ...
    std = capsys.readouterr()
    assert "broken.jpg" in std.err and "1 of 6 images could not be read" in std.err
    assert len(std.out.strip().splitlines()) == 5  # ... the others were captioned
    results = json.loads(out.read_text())
    assert len(results) == 5 and len({type(r["image_id"]) for r in results}) == 1
    for r in results:
        assert r["caption"] == " ".join(r["words"])
        assert len(r["attention"]) == len(r["words"]) and len(r["attention"][0]) == 14
        assert abs(sum(map(sum, r["attention"][0])) - 1) < 1e-3
    log = tmp_path / "res.jsonl"
    lines = log.read_text().splitlines()
    assert len(lines) == 5
    # A run killed while writing leaves a cut line; --resume drops it and redoes that image only.
    log.write_text("\n".join(lines[:3]) + "\n" + lines[3][:20])
    assert cli.main(["caption", str(folder), str(bad), *common, "--resume", "--recursive"]) == 2
    std = capsys.readouterr()
    assert "3 of 7 images already captioned" in std.err
    assert len(std.out.strip().splitlines()) == 3  # 2 redone + the subfolder's image
    assert len(json.loads(out.read_text())) == 6 and len(log.read_text().splitlines()) == 6
    # Without --resume an existing log is not overwritten.
    assert cli.main(args) == 2
    assert "--resume" in capsys.readouterr().err


def test_sampled_captions_each_with_its_maps_the_same_for_the_same_seed(small_run, folder, tmp_path, capsys):
    """`--decoding sampling --n 3`: three captions an image, each with its words and maps, in the log and
    the JSON; the same seed draws the same ones; a sampling setting without sampling is refused."""
    model = ["--checkpoint", str(small_run / "best.pt")]

    def drawn(name: str, seed: str) -> list[dict]:
        out = tmp_path / name
        sampling = ["--decoding", "sampling", "--n", "3", "--top-k", "5", "--seed", seed]
        assert cli.main(["caption", str(folder), *model, "--json", str(out), "--attention", *sampling]) == 0
        return json.loads(out.read_text())

    first, again, other = drawn("a.json", "4"), drawn("b.json", "4"), drawn("c.json", "5")
    for r in first:
        assert len(r["samples"]) == 3 and r["caption"] == r["samples"][0]["caption"]
        for s in r["samples"]:
            assert s["caption"] == " ".join(s["words"]) and len(s["attention"]) == len(s["words"])
            assert abs(sum(map(sum, s["attention"][0])) - 1) < 1e-3

    def captions(results):
        return [[s["caption"] for s in r["samples"]] for r in results]

    assert captions(first) == captions(again) and captions(first) != captions(other)
    capsys.readouterr()
    assert cli.main(["caption", str(folder), *model, "--temperature", "0.5"]) == 2
    assert "--temperature: for sampling only; add --decoding sampling" in capsys.readouterr().err


@pytest.mark.slow
def test_default_model_unfamiliar_note_and_guarded_cuda(folder, tmp_path, capsys, monkeypatch):
    from captioner.serve.api import Captioner

    real = Captioner.caption_batch

    def with_familiarity(self, images, **kw):
        outs = real(self, images, **kw)
        for o in outs:
            o.familiarity = {"score": 9.5, "unfamiliar": True, "message": "unlike the training images"}
        return outs

    monkeypatch.setattr(Captioner, "caption_batch", with_familiarity)
    image = sorted(folder.glob("*.*g"))[0]
    out = tmp_path / "one.jsonl"
    assert cli.main(["caption", str(image), "--jsonl", str(out), "--device", "cpu"]) == 0  # bundled model
    std = capsys.readouterr()
    assert "bundled demo model" in std.err and "note: " in std.err and "unlike the training images" in std.err
    record = json.loads(out.read_text())
    assert record["familiarity"]["unfamiliar"] is True and "attention" not in record
    import torch

    if not torch.cuda.is_available():
        p = run_cli("-m", "captioner", "caption", str(image), "--device", "cuda")
        assert p.returncode == 2 and "error: --device cuda" in p.stderr and "Traceback" not in p.stderr


def test_a_commands_device_is_refused_by_name_as_its_options_are_read(capsys):
    """Every command's --device is checked in one place: where `options.from_args` reads it."""
    given = ["evaluate", "--checkpoint", "c.pt", "--data", "d", "--out", "m.json", "--device"]
    parser = train_cli.get_parser()
    with pytest.raises(OptionError, match=r"^--device: expected auto, cpu, cuda or cuda:N, got 'gpu'$"):
        from_args(train_cli.EvaluateOptions, parser.parse_args([*given, "gpu"]))
    assert from_args(train_cli.EvaluateOptions, parser.parse_args([*given, "cuda:1"])).device == "cuda:1"
    assert cli.main(["caption", "x.jpg", "--device", "cuda:x"]) == 2
    assert "error: --device: expected auto, cpu, cuda or cuda:N, got 'cuda:x'" in capsys.readouterr().err
