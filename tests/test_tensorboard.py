"""`fit --tensorboard DIR`: the run's log as TensorBoard event files, read back with TensorBoard's own reader."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from conftest import SMALL_FIT, run_cli

from captioner.cli.train import get_parser
from captioner.data.dataset import CaptionData
from captioner.decoding.beams import Hypothesis
from captioner.models.decoder import DecoderConfig
from captioner.options import from_args
from captioner.train.config import TrainConfig
from captioner.train.log import EXAMPLES, TensorBoard, open_board
from captioner.train.trainer import FitJob, fit

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")

SMALL = DecoderConfig(0, embed_dim=32, hidden_dim=48, attention_dim=24, dropout=0.1)
TINY = [
    "--epochs",
    "1",
    "--batch-size",
    "4",
    "--log-every",
    "2",
    *SMALL_FIT,
]


# helpers


def board(path) -> event_accumulator.EventAccumulator:
    """Every event under `path`, as TensorBoard reads them (purged steps left out), none sampled away."""
    keep_all = {"scalars": 0, "images": 0, "tensors": 0}
    return event_accumulator.EventAccumulator(str(path), size_guidance=keep_all).Reload()


def steps(acc, tag: str) -> list[int]:
    return [e.step for e in acc.Scalars(tag)]


def records(run, event: str) -> list[dict]:
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if r["event"] == event]


def train(data_dir, run, tb, *, epochs: int, resume: bool = False):
    cfg = TrainConfig.of(epochs=epochs, batch_size=8, lr=3e-3, val_beam_size=1, log_every=2, tensorboard=str(tb))
    return fit(FitJob(str(data_dir), str(run), SMALL, cfg, resume=resume, device="cpu", progress_bar=False))


def torchrun(*args: str):
    """`torchrun --standalone --nproc-per-node 2 ...` on CPUs (gloo), as tests/test_distributed.py runs it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return run_cli("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args, env=env)


# tests


def test_the_option_names_the_folder_and_is_off_unless_given():
    args = get_parser().parse_args(["fit", "--data", "d", "--out", "o", "--tensorboard", "runs/a"])
    assert from_args(TrainConfig, args).process.tensorboard == "runs/a"
    args = get_parser().parse_args(["fit", "--data", "d", "--out", "o"])
    assert from_args(TrainConfig, args).process.tensorboard is None


def test_records_become_scalars_with_the_steps_per_second_between_them(tmp_path):
    """Each loss term, the rate and the machine's figures at a training line; the steps per second since the
    previous record; a validation's scores and attention health; text and non-finite values left out."""
    tb = TensorBoard(str(tmp_path), resumed_at=None)
    tb.write({"event": "start", "step": 10, "epoch": 0, "train": {"lr": 1.0}, "time": 1.0})
    tb.write(
        {"event": "train", "step": 20, "epoch": 0, "lr": 0.001, "load_s": 0.5, "loss": 3.0, "nll": 2.5, "time": 5.0}
    )
    health = {"entropy": 0.5, "stay": 0.2, "border": 1.0, "top5": 0.1, "words": 40, "captions": 5}
    val = {"BLEU-4": 0.1, "CIDEr": 0.4, "example": "a cat", "attention_health": health, "seconds": 2.0, "lr": 0.001}
    tb.write({"event": "val", "step": 20, "epoch": 1, **val, "best": 0.4, "best_step": 20, "healthy": True, "time": 8})
    tb.write({"event": "train", "step": 30, "epoch": 1, "lr": 0.0005, "loss": float("nan"), "nll": 2.0, "time": 10.0})
    tb.close()
    acc = board(tmp_path)
    assert [(e.step, e.value) for e in acc.Scalars("machine/steps_per_s")] == [(20, 2.5), (30, 5.0)]
    assert [(e.step, e.value) for e in acc.Scalars("train/nll")] == [(20, 2.5), (30, 2.0)]
    assert steps(acc, "train/loss") == [20] and steps(acc, "train/lr") == [20, 30]
    assert [e.value for e in acc.Scalars("val/CIDEr")] == [pytest.approx(0.4)]
    assert [e.value for e in acc.Scalars("attention_health/top5")] == [pytest.approx(0.1)]
    assert [e.value for e in acc.Scalars("val/healthy")] == [1.0]
    assert {"val/lr", "val/best_step", "val/example", "train/epoch", "train/time"}.isdisjoint(acc.Tags()["scalars"])


def test_a_fresh_run_hides_what_an_earlier_run_left_in_its_folder(tmp_path):
    for loss in (9.0, 1.0):
        tb = TensorBoard(str(tmp_path), resumed_at=None)
        tb.write({"event": "train", "step": 5, "loss": loss, "time": 1.0})
        tb.close()
    assert len(os.listdir(tmp_path)) == 2
    assert [(e.step, e.value) for e in board(tmp_path).Scalars("train/loss")] == [(5, 1.0)]


def test_a_resumed_board_drops_what_its_stopped_run_wrote_after_last_pt(tmp_path):
    """A run stopped at step 15 whose last.pt holds step 10 takes steps 11 on again: each is shown once, as the
    resumed run wrote it, and the steps up to last.pt's stay."""
    tb = open_board(str(tmp_path), main=True, saved=None)
    for step in (5, 10, 15):
        tb.write({"event": "train", "step": step, "loss": 9.0, "time": float(step)})
    tb.close()
    assert open_board(str(tmp_path), main=False, saved={"step": 10}) is None  # rank 0 alone writes
    tb = open_board(str(tmp_path), main=True, saved={"step": 10})
    tb.write({"event": "train", "step": 15, "loss": 1.0, "time": 15.0})
    tb.close()
    assert [(e.step, e.value) for e in board(tmp_path).Scalars("train/loss")] == [(5, 9.0), (10, 9.0), (15, 1.0)]


def test_examples_show_captions_and_attention_and_skip_a_missing_picture(data_dir, tmp_path):
    data = CaptionData(str(data_dir))
    ids, rows = data.split_images("val")
    g = data.encoder.grid
    hyps = {
        int(i): Hypothesis([4, 5, 6], -1.0, np.full((3, g * g), 1 / g**2, np.float32), np.full(3, -1), True)
        for i in ids
    }
    gone = int(sorted(hyps)[0])
    path_of = data.path_of
    data.path_of = lambda row: str(tmp_path / "gone.png") if row == dict(zip(ids, rows))[gone] else path_of(row)
    tb = TensorBoard(str(tmp_path / "tb"), resumed_at=None)
    tb.examples(7, data, hyps)
    tb.close()
    acc = board(tmp_path / "tb")
    shown = sorted(hyps)[:EXAMPLES]
    assert sorted(acc.Tags()["tensors"]) == sorted(f"captions/{i}/text_summary" for i in shown)
    assert sorted(acc.Tags()["images"]) == sorted(f"attention_maps/{i}" for i in shown if i != gone)
    text = acc.Tensors(f"captions/{gone}/text_summary")[0].tensor_proto.string_val[0].decode()
    caption = " ".join(data.vocab.decode([4, 5, 6]))
    assert text.startswith(f"**{caption}**") and "no picture" in text and "gone.png" in text
    image = acc.Images(f"attention_maps/{shown[1]}")[0]
    assert image.step == 7 and image.width > 3 * image.height / 2  # the image and a panel per word, in a row


def test_without_tensorboard_the_option_is_one_line_naming_the_extra(data_dir, tmp_path):
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "tensorboard.py").write_text("raise ImportError('tensorboard is not installed in this test')\n")
    env = {**os.environ, "PYTHONPATH": f"{fake}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    tb = tmp_path / "tb"
    out = ["--data", str(data_dir), "--out", str(tmp_path / "run"), "--tensorboard", str(tb)]
    p = run_cli("train.py", "fit", *out, *TINY, env=env)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith("error: --tensorboard needs the tensorboard package")
    assert "pip install 'captioner[train]'" in p.stderr and not tb.exists()


@pytest.mark.slow
def test_a_run_writes_its_log_and_examples_at_its_steps(data_dir, tmp_path):
    run, tb = tmp_path / "run", tmp_path / "tb"
    train(data_dir, run, tb, epochs=2)
    acc = board(tb)
    lines, vals = records(run, "train"), records(run, "val")
    for tag in ("train/loss", "train/nll", "train/lr", "train/grad_norm", "machine/steps_per_s", "machine/load_s"):
        assert steps(acc, tag) == [r["step"] for r in lines], tag
    assert [e.value for e in acc.Scalars("train/loss")] == pytest.approx([r["loss"] for r in lines], rel=1e-6)
    for tag in ("val/BLEU-4", "val/CIDEr", "attention_health/entropy", "attention_health/top5"):
        assert steps(acc, tag) == [r["step"] for r in vals] and len(vals) == 2, tag
    assert [e.value for e in acc.Scalars("val/CIDEr")] == pytest.approx([r["CIDEr"] for r in vals], rel=1e-6)
    images = acc.Tags()["images"]
    assert len(images) == EXAMPLES and all(t.startswith("attention_maps/") for t in images)
    assert all([e.step for e in acc.Images(t)] == [r["step"] for r in vals] for t in images)
    assert len(acc.Tags()["tensors"]) == EXAMPLES


@pytest.mark.slow
def test_a_resumed_run_goes_on_in_the_same_log_each_step_once(data_dir, tmp_path):
    """The run stopped after writing events past its last.pt (a crash between saves): resumed, those steps are
    shown once, as the resumed run took them, and its steps go on from last.pt's."""
    run, tb = tmp_path / "run", tmp_path / "tb"
    train(data_dir, run, tb, epochs=1)
    shutil.copy(run / "last.pt", tmp_path / "epoch1.pt")
    first = records(run, "val")[-1]["step"]
    train(data_dir, run, tb, epochs=2, resume=True)
    shutil.copy(tmp_path / "epoch1.pt", run / "last.pt")  # the second epoch's events stay in tb, its last.pt not
    end = train(data_dir, run, tb, epochs=2, resume=True).step
    acc = board(tb)
    lines = sorted({r["step"] for r in records(run, "train")})
    assert len(os.listdir(tb)) == 3 and lines[-1] == end > first
    for tag in ("train/loss", "machine/steps_per_s", "val/CIDEr"):
        shown = steps(acc, tag)
        assert shown == sorted(set(shown)), tag  # no step twice, none backwards
    assert steps(acc, "train/loss") == lines
    assert steps(acc, "val/CIDEr") == [first, end]
    assert all([e.step for e in acc.Images(t)] == [first, end] for t in acc.Tags()["images"])


@pytest.mark.slow
def test_under_torchrun_only_rank_0_writes(data_dir, tmp_path):
    run, tb = tmp_path / "run", tmp_path / "tb"
    p = torchrun("train.py", "fit", "--data", str(data_dir), "--out", str(run), "--tensorboard", str(tb), *TINY)
    assert p.returncode == 0, p.stderr[-3000:]
    assert len(os.listdir(tb)) == 1  # one writer
    acc = board(tb)
    assert steps(acc, "train/loss") == [r["step"] for r in records(run, "train")]
    assert steps(acc, "val/CIDEr") == [r["step"] for r in records(run, "val")]
    val = CaptionData(str(data_dir)).split_images("val")[0]
    assert len(acc.Tags()["images"]) == min(EXAMPLES, len(val[0::2]))  # rank 0's share of the images
