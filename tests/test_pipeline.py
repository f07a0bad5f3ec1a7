"""prepare → fit → evaluate → caption, end to end, and the checkpoint contract."""

from __future__ import annotations

import json
import logging
import os
import shutil

import numpy as np
import pytest
import torch
from conftest import prepare_scenes, run_cli
from PIL import Image

from captioner import Captioner, CaptionerError
from captioner.cli import train as train_cli
from captioner.data.dataset import CaptionData
from captioner.decoding.settings import Decoding
from captioner.evaluation.evaluate import evaluate
from captioner.evaluation.maps import upsample
from captioner.models.checkpoint import load_checkpoint, save_checkpoint
from captioner.serve.heatmaps import attention_figure

METRICS = ["BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "METEOR", "ROUGE-L", "CIDEr"]


def test_fit_writes_plain_checkpoints_and_a_log(small_run):
    for name in ("best.pt", "last.pt"):
        ck = torch.load(small_run / name, map_location="cpu", weights_only=True)
        assert isinstance(ck["step"], int) and ck["step"] > 0
        assert ck["encoder"]["weights"] == "none" and ck["encoder"]["fingerprint"]
        assert ck["vocab"][:4] == ["<pad>", "<start>", "<end>", "<unk>"]
    log = [json.loads(line) for line in (small_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in log if r["event"] == "val"] == [1, 2]
    assert all(np.isfinite(r["loss"]) for r in log if r["event"] == "train")


@pytest.mark.slow
def test_evaluate_cli_writes_metrics_and_results(small_run, data_dir, scenes, tmp_path):
    out = tmp_path / "eval" / "metrics.json"
    p = run_cli(
        "train.py",
        "evaluate",
        "--checkpoint",
        str(small_run / "best.pt"),
        "--data",
        str(data_dir),
        "--split",
        "test",
        "--out",
        str(out),
        "--grounding",
        str(scenes / "boxes.json"),
    )
    assert p.returncode == 0, p.stderr
    metrics = json.loads(out.read_text())
    assert all(k in metrics for k in METRICS)
    # --grounding was given: the words naming boxed objects were scored, and pointing is their hit rate.
    grounding = metrics["grounding"]
    assert grounding["words"] > 0 and metrics["pointing"] is not None and 0 <= metrics["pointing"] <= 1
    hits = sum(h for h, _ in grounding["by_word"].values())
    assert metrics["pointing"] == pytest.approx(hits / grounding["words"])
    results = json.loads((tmp_path / "eval" / "metrics_results.json").read_text())
    ids, _ = CaptionData(str(data_dir)).split_images("test")
    assert sorted(r["image_id"] for r in results) == sorted(ids.tolist())
    assert all(isinstance(r["caption"], str) and "<" not in r["caption"] for r in results)


def test_evaluate_decodes_as_its_settings_say(small_run, data_dir, tmp_path, capsys):
    """evaluate with sampling at temperature 0 writes the greedy captions; the settings go in the metrics;
    `--decoding sampling --n 2` is refused (one caption per image is scored)."""
    ckpt = str(small_run / "best.pt")

    def evaluated(name: str, decoding: Decoding) -> tuple[dict, list]:
        out = tmp_path / f"{name}.json"
        metrics = evaluate(ckpt, str(data_dir), "test", str(out), decoding=decoding, use_java=False)
        return metrics, json.loads((tmp_path / f"{name}_results.json").read_text())

    greedy, greedy_texts = evaluated("greedy", Decoding(beam_size=1))
    drawn, drawn_texts = evaluated("drawn", Decoding(method="sampling", temperature=0.0, seed=3))
    assert drawn_texts == greedy_texts and drawn["decoding"]["method"] == "sampling"
    assert greedy["decoding"]["beam_size"] == greedy["beam_size"] == 1
    args = ["evaluate", "--checkpoint", ckpt, "--data", str(data_dir), "--out", str(tmp_path / "n.json")]
    assert train_cli.main([*args, "--decoding", "sampling", "--n", "2"]) == 2
    assert "--n must be 1" in capsys.readouterr().err


@pytest.mark.slow
def test_evaluate_without_java_says_so_and_marks_the_figures(small_run, data_dir, tmp_path):
    """No `java` on the PATH: evaluate still scores, but warns naming Java and writes official: false."""
    out = tmp_path / "m.json"
    args = [
        "train.py",
        "evaluate",
        "--checkpoint",
        str(small_run / "best.pt"),
        "--data",
        str(data_dir),
        "--out",
        str(out),
        "--beam-size",
        "1",
    ]
    p = run_cli(*args, env={**os.environ, "PATH": str(tmp_path)})
    assert p.returncode == 0, p.stderr
    assert "warning: Java was not found" in p.stderr and "Traceback" not in p.stderr
    m = json.loads(out.read_text())
    assert m["official"] is False and m["METEOR"] is None and m["BLEU-4"] is not None
    if shutil.which("java"):
        p = run_cli(*args)
        assert p.returncode == 0 and "Java" not in p.stderr, p.stderr
        assert json.loads(out.read_text())["official"] is True


@pytest.mark.slow
def test_evaluate_counts_the_split_images_it_could_not_score(small_run, scenes, tmp_path, caplog):
    """A test image that was unreadable at prepare time is named in the count, not silently dropped."""
    copy = tmp_path / "scenes"
    shutil.copytree(scenes, copy)
    test_ids = {
        im["cocoid"] for im in json.loads((copy / "splits.json").read_text())["images"] if im["split"] == "test"
    }
    bad = next(im for im in json.loads((copy / "captions.json").read_text())["images"] if im["id"] in test_ids)
    (copy / "images" / bad["file_name"]).write_bytes(b"not an image")
    data = tmp_path / "data"
    prepare_scenes(copy, data, min_count=1, skip_bad=True)
    caplog.set_level(logging.WARNING, logger="captioner")
    m = evaluate(
        str(small_run / "best.pt"),
        str(data),
        "test",
        str(tmp_path / "m.json"),
        decoding=Decoding(beam_size=1),
        use_java=False,
    )
    assert m["missing_images"] == 1 and m["missing_image_ids"] == [bad["id"]]
    assert m["split_images"] == m["images"] + 1 == len(test_ids)
    assert f"1 of the {len(test_ids)} test images were not scored" in caplog.text


def test_checkpoint_round_trip_gives_identical_outputs(small_run, scenes, tmp_path):
    image = sorted((scenes / "images").iterdir())[0]
    a = Captioner.load(str(small_run / "best.pt"))
    ck = load_checkpoint(str(small_run / "best.pt"))
    assert ck["decoder"]["word_query"] is False  # without boxes, the paper's query
    assert ck["decoder"]["decode_sharpness"] == 1.0  # and the maps as trained
    save_checkpoint({k: v for k, v in ck.items() if k != "format"}, str(tmp_path / "copy.pt"))
    b = Captioner.load(str(tmp_path / "copy.pt"))
    oa, ob = a.caption(image, beam_size=3), b.caption(image, beam_size=3)
    assert oa.words == ob.words and oa.score == ob.score
    np.testing.assert_array_equal(oa.attention, ob.attention)


def test_api_contract(small_run, scenes):
    cap = Captioner.load(str(small_run / "best.pt"))
    paths = sorted((scenes / "images").iterdir())[:3]
    out = cap.caption(Image.open(paths[0]), beam_size=3)
    assert isinstance(out.text, str) and out.text == " ".join(out.words)
    assert out.attention.shape == (len(out.words), 14, 14)
    assert out.words
    np.testing.assert_allclose(out.attention.reshape(len(out.words), 196).sum(1), 1.0, rtol=1e-4)
    assert not {"<start>", "<end>", "<pad>"} & set(out.words)
    batch = cap.caption_batch([str(p) for p in paths], beam_size=2)
    assert len(batch) == 3
    single = cap.caption(str(paths[1]), beam_size=2)
    assert batch[1].words == single.words


def test_pickled_checkpoint_is_refused_without_running(tmp_path, small_run):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            import os

            return (os.system, (f"touch {marker}",))

    ck = torch.load(small_run / "best.pt", map_location="cpu", weights_only=True)
    ck["evil"] = Payload()
    torch.save(ck, tmp_path / "evil.pt")
    with pytest.raises(CaptionerError, match="refused"):
        Captioner.load(str(tmp_path / "evil.pt"))
    assert not marker.exists()


def test_broken_checkpoints_are_explained(tmp_path, small_run):
    data = (small_run / "best.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CaptionerError, match="cut.pt: not a readable checkpoint"):
        Captioner.load(str(tmp_path / "cut.pt"))
    torch.save({"model": {}}, tmp_path / "other.pt")
    with pytest.raises(CaptionerError, match="not a captioner checkpoint"):
        Captioner.load(str(tmp_path / "other.pt"))


@pytest.mark.slow
def test_caption_cli_json_and_figures(small_run, scenes, tmp_path):
    paths = [str(p) for p in sorted((scenes / "images").iterdir())[:2]]
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"nope")
    p = run_cli(
        "-m",
        "captioner",
        "caption",
        *paths,
        str(bad),
        "--checkpoint",
        str(small_run / "best.pt"),
        "--json",
        str(tmp_path / "res.json"),
        "--figures",
        str(tmp_path / "figs"),
    )
    assert p.returncode == 2 and "bad.jpg" in p.stderr and "Traceback" not in p.stderr
    res = json.loads((tmp_path / "res.json").read_text())
    assert len(res) == 2 and all({"image_id", "caption"} <= set(r) for r in res)
    figs = sorted((tmp_path / "figs").iterdir())
    assert len(figs) == 2 and Image.open(figs[0]).size[0] > 100


def test_heatmap_peak_lands_where_attention_is():
    att = np.zeros((14, 14), np.float32)
    att[3, 10] = 1.0
    heat = upsample(att, (280, 140))
    y, x = np.unravel_index(heat.argmax(), heat.shape)
    assert heat.shape == (140, 280)
    assert 10 * 20 <= x < 11 * 20 and 3 * 10 <= y < 4 * 10
    fig = attention_figure(Image.new("RGB", (280, 140)), ["a", "dot"], np.stack([att, att]))
    assert len([ax for ax in fig.axes if ax.images]) == 3  # the image, then one panel per word


def test_heatmaps_of_thin_and_tiny_images():
    for size in ((512, 40), (40, 512), (1, 1), (3000, 3)):
        heat = upsample(np.random.rand(14, 14), size)
        assert heat.shape == (size[1], size[0]) and np.isfinite(heat).all()
    fig = attention_figure(Image.new("RGB", (900, 30)), ["a"], np.random.rand(1, 14, 14))
    assert len(fig.axes) >= 2
