"""COCO reading, vocabulary and `prepare`: bad input gets a message naming the file and field."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from conftest import prepare_scenes, run_cli
from PIL import Image

from captioner.data.batches import bucket_batches
from captioner.data.coco import default_splits, load_dataset
from captioner.data.dataset import DONE, TODO, CaptionData
from captioner.errors import CaptionerError
from captioner.models.encoder import EncoderSpec
from captioner.models.vocab import END_ID, START_ID, UNK_ID, Vocabulary, tokenize
from captioner.train.prepare import PrepareConfig, prepare


def test_tokenize():
    assert tokenize("A man, riding a Horse.") == ["a", "man", "riding", "a", "horse"]
    assert tokenize('  Two dogs... "playing"! ') == ["two", "dogs", "playing"]
    assert tokenize("") == []


def test_vocabulary_min_count_and_round_trip():
    vocab = Vocabulary.build([["a", "dog"], ["a", "cat"], ["a", "dog"]], min_count=2)
    assert vocab.words == ["<pad>", "<start>", "<end>", "<unk>", "a", "dog"]
    ids = vocab.encode(["a", "cat", "dog"])
    assert ids == [START_ID, 4, UNK_ID, 5, END_ID]
    assert vocab.decode(ids + [0, 0]) == ["a", "<unk>", "dog"]
    assert vocab.decode([START_ID, 4, END_ID, 5]) == ["a"]  # cut at <end>


def write(path, obj):
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return str(path)


def mini_coco(tmp_path, n=3):
    images = tmp_path / "imgs"
    images.mkdir(exist_ok=True)
    entries, anns = [], []
    for k in range(n):
        name = f"im{k}.png"
        Image.new("RGB", (20 + k, 16), (200, 10 * k, 0)).save(images / name)
        entries.append({"id": 100 + 7 * k, "file_name": name, "width": 20 + k, "height": 16})
        anns += [
            {"id": 1000 + 10 * k + j, "image_id": 100 + 7 * k, "caption": f"A red thing number {j}."} for j in range(2)
        ]
    return images, {"images": entries, "annotations": anns}


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"images": [', "malformed JSON.*truncated"),
        ("", "empty"),
        ('{"images": [] "annotations": []}', "malformed JSON at line 1"),
        ("[1, 2]", "top level: expected a JSON object"),
        ('{"annotations": []}', "missing the 'images' field"),
        ('{"images": [{"file_name": "a.jpg"}], "annotations": []}', r"images\[0\]: missing the 'id' field"),
        ('{"images": [{"id": "7", "file_name": "a.jpg"}], "annotations": []}', r"images\[0\].id: must be int"),
        (
            '{"images": [{"id": 1, "file_name": "a"}, {"id": 1, "file_name": "b"}], "annotations": []}',
            "duplicate image id 1",
        ),
        (
            '{"images": [{"id": 1, "file_name": "a"}], "annotations": [{"image_id": 1}]}',
            r"annotations\[0\]: missing the 'image_id' or 'caption'",
        ),
        (
            '{"images": [{"id": 1, "file_name": "a"}], "annotations": [{"image_id": 2, "caption": "x"}]}',
            "image_id 2 is not in 'images'",
        ),
        (
            '{"images": [{"id": 1, "file_name": "a"}], "annotations": [{"image_id": 1, "caption": 5}]}',
            "caption must be a string",
        ),
        (
            '{"images": [{"id": 1, "file_name": "a"}], "annotations": [{"image_id": 1, "caption": "  "}]}',
            "caption is empty",
        ),
    ],
)
def test_bad_caption_files_are_explained(tmp_path, content, message):
    images, _ = mini_coco(tmp_path)
    path = write(tmp_path / "caps.json", content)
    with pytest.raises(CaptionerError, match=message) as e:
        load_dataset([path], [str(images)])
    assert "caps.json" in str(e.value)


def test_non_utf8_is_explained(tmp_path):
    images, _ = mini_coco(tmp_path)
    path = tmp_path / "caps.json"
    path.write_bytes(b'{"images": [], "annotations": [{"caption": "caf\xe9"}]}')
    with pytest.raises(CaptionerError, match="caps.json: not UTF-8"):
        load_dataset([str(path)], [str(images)])


def test_skip_bad_counts_what_it_skips(tmp_path):
    images, coco = mini_coco(tmp_path)
    coco["annotations"].append({"id": 1, "image_id": 100, "caption": ""})
    coco["annotations"].append({"id": 2, "image_id": 99999, "caption": "ghost"})
    records, skipped = load_dataset([write(tmp_path / "c.json", coco)], [str(images)], skip_bad=True)
    assert len(records) == 3 and len(skipped.bad_annotations) == 2


def test_missing_image_is_named_or_skipped(tmp_path):
    images, coco = mini_coco(tmp_path)
    (images / "im1.png").unlink()
    path = write(tmp_path / "c.json", coco)
    with pytest.raises(CaptionerError, match="im1.png.*id 107.*--skip-missing"):
        load_dataset([path], [str(images)])
    records, skipped = load_dataset([path], [str(images)], skip_missing=True)
    assert [r.image_id for r in records] == [100, 114] and skipped.missing_images == ["im1.png"]


def test_karpathy_split_and_several_caption_files(tmp_path):
    images, coco = mini_coco(tmp_path, n=4)
    first = {"images": coco["images"][:2], "annotations": [a for a in coco["annotations"] if a["image_id"] < 110]}
    second = {"images": coco["images"][2:], "annotations": [a for a in coco["annotations"] if a["image_id"] >= 110]}
    split = {
        "images": [
            {"cocoid": 100, "split": "train"},
            {"cocoid": 107, "split": "restval"},
            {"cocoid": 114, "split": "test"},
        ]
    }
    records, _ = load_dataset(
        [write(tmp_path / "a.json", first), write(tmp_path / "b.json", second)],
        [str(images)],
        write(tmp_path / "s.json", split),
    )
    assert {r.image_id: r.split for r in records} == {100: "train", 107: "train", 114: "test"}
    with pytest.raises(CaptionerError, match="not in the caption files"):
        load_dataset([write(tmp_path / "a.json", first)], [str(images)], str(tmp_path / "s.json"))


def test_default_split_is_deterministic():
    ids = list(range(5, 1005, 3))
    s1, s2 = default_splits(ids), default_splits(list(reversed(ids)))
    assert s1 == s2
    counts = {k: list(s1.values()).count(k) for k in ("train", "val", "test")}
    assert counts["val"] == counts["test"] == round(0.05 * len(ids))


def test_bucketed_batches_cover_every_caption_once():
    lengths = np.random.RandomState(0).randint(5, 20, size=103)
    batches = bucket_batches(lengths, 8, seed=1, epoch=2)
    assert sorted(np.concatenate(batches).tolist()) == list(range(103))
    assert np.mean([np.ptp(lengths[b]) for b in batches]) <= 1.0  # similar lengths together
    again = bucket_batches(lengths, 8, seed=1, epoch=2)
    assert all((a == b).all() for a, b in zip(batches, again))
    assert any((a != b).any() for a, b in zip(batches, bucket_batches(lengths, 8, seed=1, epoch=3)))


@pytest.mark.slow
def test_prepare_unreadable_image_named_then_skipped(tmp_path):
    images, coco = mini_coco(tmp_path)
    (images / "im2.png").write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    path = write(tmp_path / "c.json", coco)
    out = tmp_path / "data"
    with pytest.raises(CaptionerError, match="im2.png.*--skip-bad"):
        prepare(
            PrepareConfig(
                captions=[path],
                images=[str(images)],
                out=str(out),
                encoder=EncoderSpec(weights="none"),
                min_count=1,
                workers=0,
            ),
            progress=False,
        )
    summary = prepare(
        PrepareConfig(
            captions=[path],
            images=[str(images)],
            out=str(out),
            encoder=EncoderSpec(weights="none"),
            min_count=1,
            workers=0,
            skip_bad=True,
        ),
        progress=False,
    )
    assert summary["bad_images"] == 1
    data = CaptionData(str(out))
    assert 114 not in np.concatenate([data.split_images(s)[0] for s in ("train",)]).tolist()


@pytest.mark.slow
def test_prepare_resumes_without_redoing_work(tmp_path, scenes, data_dir):
    out = tmp_path / "data"
    shutil.copytree(data_dir, out)
    meta = json.loads((out / "meta.json").read_text())
    (out / "meta.json").write_text(json.dumps({**meta, "complete": False}))  # as if interrupted
    done = np.memmap(out / "features.done", dtype=np.uint8, mode="r+")
    feats = np.load(out / "features.npy", mmap_mode="r+")
    reference = np.array(feats[:5])
    feats[3] = 0  # a row whose write was cut short is not marked done...
    done[3] = TODO
    feats[0] = 7  # ...and a finished row must not be recomputed
    feats.flush(), done.flush()
    with pytest.raises(CaptionerError, match="has not finished"):
        CaptionData(str(out))
    prepare_scenes(scenes, out, min_count=1)
    feats = np.load(out / "features.npy", mmap_mode="r")
    np.testing.assert_array_equal(feats[3], reference[3])
    assert (feats[0] == 7).all()
    assert (np.memmap(out / "features.done", dtype=np.uint8, mode="r") == DONE).all()
    CaptionData(str(out))


@pytest.mark.slow
def test_prepare_refuses_to_mix_caches(tmp_path, scenes, data_dir):
    out = tmp_path / "data"
    shutil.copytree(data_dir, out)
    with pytest.raises(CaptionerError, match="different encoder"):
        prepare_scenes(scenes, out, encoder=EncoderSpec(weights="none", seed=5))


@pytest.mark.slow
def test_prepare_cli_errors_are_one_line(tmp_path, scenes):
    bad = write(tmp_path / "trunc.json", (scenes / "captions.json").read_text()[:500])
    p = run_cli(
        "train.py",
        "prepare",
        "--images",
        str(scenes / "images"),
        "--captions",
        bad,
        "--out",
        str(tmp_path / "d"),
        "--encoder-weights",
        "none",
    )
    assert p.returncode == 2
    assert "Traceback" not in p.stderr
    assert p.stderr.startswith("error: ") and "trunc.json" in p.stderr and "truncated" in p.stderr
    p = run_cli("train.py", "fit", "--data", str(tmp_path / "nothing"), "--out", str(tmp_path / "r"))
    assert p.returncode == 2 and "not a prepared data directory" in p.stderr and "Traceback" not in p.stderr
