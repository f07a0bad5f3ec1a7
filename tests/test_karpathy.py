"""`prepare --karpathy`: Karpathy's dataset files (COCO and Flickr layouts) alone, checked like COCO files."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli
from PIL import Image

from captioner.data.dataset import CaptionData
from captioner.data.karpathy import load_karpathy
from captioner.errors import CaptionerError
from captioner.models.encoder import EncoderSpec
from captioner.train.prepare import PrepareConfig, prepare

SPLITS = ["train", "restval", "val", "test", "train", "restval"]


def coco_layout(tmp_path):
    """COCO's dataset_coco.json: filepath/filename, cocoid ids (imgid a running index), raw and tokens."""
    for sub in ("train2014", "val2014"):
        (tmp_path / "coco" / sub).mkdir(parents=True, exist_ok=True)
    images = []
    for k, split in enumerate(SPLITS):
        sub = "train2014" if split in ("train", "restval") else "val2014"
        name = f"COCO_{sub}_{k:012d}.jpg"
        Image.new("RGB", (40 + k, 30), (20 * k, 100, 50)).save(tmp_path / "coco" / sub / name)
        sentences = [
            {"tokens": ["a", "red", "box", str(k)], "raw": f"A red box {k}.", "imgid": k, "sentid": 2 * k},
            {"tokens": ["the", "box", "number", str(k)], "raw": f"The box number {k}", "imgid": k, "sentid": 2 * k + 1},
        ]
        images.append(
            {
                "filepath": sub,
                "filename": name,
                "imgid": k,
                "cocoid": 5000 + 17 * k,
                "split": split,
                "sentids": [2 * k, 2 * k + 1],
                "sentences": sentences,
            }
        )
    return tmp_path / "coco", {"images": images, "dataset": "coco"}


def flickr_layout(tmp_path):
    """Flickr8k/30k: filename only, imgid the only id; a sentence without 'raw' keeps its tokens."""
    root = tmp_path / "Flicker8k_Dataset"
    root.mkdir(exist_ok=True)
    images = []
    for k, split in enumerate(SPLITS):
        name = f"{1000 + k}_abc{k}.jpg"
        Image.new("RGB", (30, 40 + k), (100, 20 * k, 50)).save(root / name)
        sentences = [
            {"tokens": ["a", "dog", "runs", str(k)], "raw": f"A dog runs {k} .", "imgid": k, "sentid": 2 * k},
            {"tokens": ["dogs", "play", str(k)], "imgid": k, "sentid": 2 * k + 1},
        ]
        images.append(
            {"filename": name, "imgid": k, "split": split, "sentids": [2 * k, 2 * k + 1], "sentences": sentences}
        )
    return root, {"images": images, "dataset": "flickr8k"}


def write(path, obj) -> str:
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return str(path)


def test_coco_layout_ids_paths_and_restval(tmp_path):
    root, data = coco_layout(tmp_path)
    records, skipped = load_karpathy(write(tmp_path / "dataset_coco.json", data), [str(root)])
    assert [r.image_id for r in records] == [5000 + 17 * k for k in range(6)]  # cocoid, not imgid
    assert [r.split for r in records] == ["train", "train", "val", "test", "train", "train"]  # restval → train
    assert records[2].path == str(root / "val2014" / "COCO_val2014_000000000002.jpg")  # DIR/filepath/filename
    assert records[0].captions == ["A red box 0.", "The box number 0"]  # raw
    assert not skipped.report()
    # train2014 and val2014 given as two directories also find every image (DIR/filename).
    again, _ = load_karpathy(str(tmp_path / "dataset_coco.json"), [str(root / "train2014"), str(root / "val2014")])
    assert [r.path for r in again] == [r.path for r in records]


def test_flickr_layout_imgid_filename_and_tokens(tmp_path):
    root, data = flickr_layout(tmp_path)
    records, _ = load_karpathy(write(tmp_path / "dataset_flickr8k.json", data), [str(root)])
    assert [r.image_id for r in records] == list(range(6))
    assert records[3].path == str(root / "1003_abc3.jpg") and records[3].split == "test"
    assert records[1].split == "train"  # restval
    assert records[4].captions == ["A dog runs 4 .", "dogs play 4"]  # tokens joined without raw


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d["images"][2].pop("sentences"), r"images\[2\] \(1002_abc2.jpg\): missing the 'sentences' field"),
        (lambda d: d["images"][1].pop("filename"), r"images\[1\]: missing the 'filename' field"),
        (lambda d: d["images"][0].pop("imgid"), r"images\[0\] \(1000_abc0.jpg\): missing the 'cocoid' or 'imgid'"),
        (
            lambda d: d["images"][4].update(split="dev"),
            r"images\[4\] .*'split' must be train, restval, val or test, got 'dev'",
        ),
        (lambda d: d["images"][5].update(imgid=0), r"images\[5\] .*duplicate image id 0"),
        (
            lambda d: d["images"][3]["sentences"][1].pop("tokens"),
            r"images\[3\] .*sentences\[1\]: missing the 'raw' field",
        ),
        (lambda d: d["images"][3]["sentences"][0].update(raw=" "), r"sentences\[0\]: the caption is empty.*--skip-bad"),
        (lambda d: d.pop("images"), r"top level: expected \{'images'"),
    ],
)
def test_bad_karpathy_files_name_the_image_and_field(tmp_path, change, message):
    root, data = flickr_layout(tmp_path)
    change(data)
    with pytest.raises(CaptionerError, match=message) as e:
        load_karpathy(write(tmp_path / "dataset_flickr8k.json", data), [str(root)])
    assert "dataset_flickr8k.json" in str(e.value)


def test_missing_image_is_named_or_skipped(tmp_path):
    root, data = coco_layout(tmp_path)
    (root / "val2014" / "COCO_val2014_000000000003.jpg").unlink()
    path = write(tmp_path / "dataset_coco.json", data)
    with pytest.raises(CaptionerError, match="val2014/COCO_val2014_000000000003.jpg .id 5051.*--skip-missing"):
        load_karpathy(path, [str(root)])
    records, skipped = load_karpathy(path, [str(root)], skip_missing=True)
    assert len(records) == 5 and "1 missing images skipped" in skipped.report()


@pytest.mark.slow
def test_prepare_karpathy_vocabulary_from_training_captions_only(tmp_path):
    root, data = flickr_layout(tmp_path)
    # Words only val/test captions use must not enter the vocabulary, however frequent.
    for img in data["images"]:
        if img["split"] in ("val", "test"):
            img["sentences"].append({"raw": "zebra zebra zebra zebra", "imgid": img["imgid"]})
    summary = prepare(
        PrepareConfig(
            images=[str(root)],
            out=str(tmp_path / "data"),
            karpathy=write(tmp_path / "d.json", data),
            encoder=EncoderSpec(weights="none", image_size=32),
            min_count=2,
            workers=0,
        ),
        progress=False,
    )
    d = CaptionData(str(tmp_path / "data"))
    assert "zebra" not in d.vocab.words and {"dog", "runs", "dogs", "play"} <= set(d.vocab.words)
    # The digits 0, 1, 4, 5 occur twice each in training captions (kept); nothing else is rarer.
    assert summary["images"] == {"train": 4, "val": 1, "test": 1}
    assert summary["min_word_freq"] == 2 and summary["words_below_min_freq"] == 0
    assert d.meta["sources"] == {"karpathy": str(tmp_path / "d.json")}
    assert sorted(d.references["test"]) == [3] and len(d.references["test"][3]) == 3


@pytest.mark.slow
def test_prepare_cli_karpathy_and_its_errors(tmp_path):
    root, data = coco_layout(tmp_path)
    path = write(tmp_path / "dataset_coco.json", data)
    p = run_cli(
        "train.py",
        "prepare",
        "--karpathy",
        path,
        "--images",
        str(root),
        "--out",
        str(tmp_path / "d"),
        "--encoder-weights",
        "none",
        "--min-word-freq",
        "3",
        "--workers",
        "0",
    )
    assert p.returncode == 0, p.stderr[-2000:]
    summary = json.loads(p.stdout)
    # Training captions: 4 images × "a red box k" / "the box number k": a, red, the, number ×4, box ×8;
    # the digits 0, 1, 4, 5 twice each fall below 3.
    assert summary["vocabulary"] == 4 + 5 and summary["words_below_min_freq"] == 4
    del data["images"][1]["sentences"]
    write(tmp_path / "dataset_coco.json", data)
    p = run_cli(
        "train.py",
        "prepare",
        "--karpathy",
        path,
        "--images",
        str(root),
        "--out",
        str(tmp_path / "e"),
        "--encoder-weights",
        "none",
    )
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip() == (
        f"error: {path}: images[1] (COCO_train2014_000000000001.jpg): missing the 'sentences' field"
    )
    p = run_cli(
        "train.py",
        "prepare",
        "--karpathy",
        path,
        "--splits",
        path,
        "--images",
        str(root),
        "--out",
        str(tmp_path / "e"),
        "--encoder-weights",
        "none",
    )
    assert p.returncode == 2 and "do not pass --captions or --splits" in p.stderr


@pytest.mark.slow
def test_held_out_scenes_rewritten_in_flickr_layout(tmp_path):
    # The acceptance check's input: benchmarks/karpathy_flickr.py on tools.heldout's splits.json.
    from tools.heldout import generate

    generate(tmp_path / "scenes", 30, seed=2)
    out = tmp_path / "dataset_flickr.json"
    p = run_cli("benchmarks/karpathy_flickr.py", str(tmp_path / "scenes" / "splits.json"), str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    flickr = json.loads(out.read_text())
    assert all("filepath" not in img and "cocoid" not in img and "/" not in img["filename"] for img in flickr["images"])
    splits = [img["split"] for img in flickr["images"]]
    assert splits.count("restval") == 3 and splits.count("train") == 21  # every tenth of 24 train images
    records, _ = load_karpathy(str(out), [str(tmp_path / "scenes" / "images")])
    coco, _ = load_karpathy(str(tmp_path / "scenes" / "splits.json"), [str(tmp_path / "scenes")])
    assert [r.image_id for r in records] == list(range(30))  # imgid, the only id left
    assert sorted((r.path, r.split, r.captions) for r in records) == sorted((r.path, r.split, r.captions) for r in coco)
