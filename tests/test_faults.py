"""What a cluster job meets: a full disk, SIGTERM, damaged feature rows, non-finite steps."""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import shlex
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest
import torch
from conftest import SMALL_FIT, prepare_scenes, train_step
from test_reliability import start, wait_for

import captioner.data.dataset as features
import captioner.models.checkpoint as checkpoint
from captioner.data.batches import CaptionBatches
from captioner.data.dataset import CaptionData
from captioner.errors import CaptionerError
from captioner.models.checkpoint import load_checkpoint
from captioner.models.decoder import AttentionDecoder, DecoderConfig
from captioner.models.encoder import EncoderSpec
from captioner.train import log as faults
from captioner.train.config import TrainConfig
from captioner.train.prepare import PrepareConfig, prepare
from captioner.train.trainer import FitJob, fit

# Saves only at the end of each epoch; a log line per step shows how far a run has got.
FIT = [
    "--epochs",
    "3",
    "--batch-size",
    "8",
    "--dropout",
    "0.3",
    "--checkpoint-every",
    "0",
    "--checkpoint-minutes",
    "0",
    "--patience",
    "10",
    "--log-every",
    "1",
    *SMALL_FIT,
]
TINY = DecoderConfig(0, embed_dim=16, hidden_dim=16, attention_dim=8)


def log_of(run) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def temp_files(d) -> list[str]:
    return [f for f in os.listdir(d) if ".tmp" in f]


def all_finite(ck: dict) -> bool:
    return faults.first_nonfinite(ck["model"]) is None


@pytest.fixture(scope="module")
def whole(data_dir, tmp_path_factory):
    """The run the interrupted ones must equal: FIT from start to end, uninterrupted."""
    out = tmp_path_factory.mktemp("whole")
    p = start("fit", "--data", str(data_dir), "--out", str(out), *FIT)
    assert p.wait() == 0, p.stderr.read()
    return out


# preemption


@pytest.mark.slow
def test_sigterm_stops_fit_after_the_step_and_resume_equals_uninterrupted(data_dir, tmp_path, whole):
    out = tmp_path / "run"
    p = start("fit", "--data", str(data_dir), "--out", str(out), *FIT)
    wait_for(
        lambda: any(r["event"] == "train" and r["step"] >= 4 for r in log_of(out)), p, "training steps", timeout=3600
    )
    p.send_signal(signal.SIGTERM)
    assert p.wait() == 0
    err = p.stderr.read()
    assert "stopped by SIGTERM at step" in err and "Traceback" not in err, err
    stopped = [r for r in log_of(out) if r["event"] == "stopped"]
    assert len(stopped) == 1 and stopped[0]["signal"] == "SIGTERM" and stopped[0]["saved"]
    step = load_checkpoint(str(out / "last.pt"))["step"]
    assert step == stopped[0]["step"] >= 4  # saved at the step it stopped after, not the last epoch's
    assert step < load_checkpoint(str(whole / "last.pt"))["step"]
    r = start("fit", "--data", str(data_dir), "--out", str(out), *FIT, "--resume")
    assert r.wait() == 0, r.stderr.read()
    resumed, reference = load_checkpoint(str(out / "last.pt")), load_checkpoint(str(whole / "last.pt"))
    assert resumed["step"] == reference["step"]
    for name, value in reference["model"].items():
        assert torch.equal(resumed["model"][name], value), name
    # The command line as typed, of the run's start: the resumed one keeps it.
    assert resumed["command"] == shlex.join(
        ["python", "train.py", "fit", "--data", str(data_dir), "--out", str(out), *FIT]
    )
    assert not temp_files(out)


def test_graceful_stop_catches_sigint_and_sigterm_then_restores_the_handlers():
    before = signal.getsignal(signal.SIGINT)
    with faults.GracefulStop(announce=False) as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGINT)  # would raise KeyboardInterrupt without the handler
        os.kill(os.getpid(), signal.SIGTERM)  # a repeat is ignored: the first signal decides
        time.sleep(0.01)
        assert stop.requested and stop.signal_name == "SIGINT" and stop.exit_status == 130
    assert signal.getsignal(signal.SIGINT) is before
    with faults.GracefulStop(announce=False) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert stop.signal_name == "SIGTERM" and stop.exit_status == 0


@pytest.mark.slow
def test_sigterm_stops_prepare_after_a_batch_then_a_full_disk_then_it_completes(
    scenes, data_dir, tmp_path, monkeypatch
):
    out = tmp_path / "data"
    inputs = dict(
        captions=[str(scenes / "captions.json")], images=[str(scenes / "images")], splits=str(scenes / "splits.json")
    )
    args = [
        "prepare",
        "--images",
        inputs["images"][0],
        "--captions",
        inputs["captions"][0],
        "--splits",
        inputs["splits"],
        "--out",
        str(out),
        "--encoder-weights",
        "none",
        "--min-count",
        "1",
        "--batch-size",
        "4",
        "--workers",
        "2",
    ]
    p = start(*args)
    done = out / "features.done"
    wait_for(
        lambda: done.exists() and (np.fromfile(done, np.uint8) == 1).sum() >= 4, p, "extracted features", timeout=3600
    )
    p.send_signal(signal.SIGTERM)
    assert p.wait() == 0  # DataLoader workers ignored the signal; the batch in hand landed
    err = p.stderr.read()
    assert "stopped by SIGTERM" in err and "Traceback" not in err, err
    assert not json.loads((out / "meta.json").read_text())["complete"]
    reference = np.load(data_dir / "features.npy", mmap_mode="r")

    def check_done_rows() -> int:
        marks = np.fromfile(done, np.uint8)
        ours = np.load(out / "features.npy", mmap_mode="r")
        rows = np.flatnonzero(marks == 1)
        np.testing.assert_allclose(
            ours[rows].astype(np.float32), reference[rows].astype(np.float32), rtol=2e-3, atol=1e-3
        )
        return len(rows)

    after_stop = check_done_rows()
    assert 4 <= after_stop < 48
    # Then the disk fills up while the next rows are written: the rows that landed are marked, no other.
    real_pwrite, writes = os.pwrite, []

    def pwrite(fd, data, offset):
        writes.append(offset)
        if len(writes) > 6:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(features.os, "pwrite", pwrite)
    with pytest.raises(CaptionerError, match="no space left on the device holding .*rows finished so far are kept"):
        prepare(
            PrepareConfig(
                **inputs, out=str(out), encoder=EncoderSpec(weights="none"), min_count=1, batch_size=4, workers=0
            ),
            progress=False,
        )
    after_full = check_done_rows()
    assert after_stop < after_full < 48
    monkeypatch.setattr(features.os, "pwrite", real_pwrite)
    prepare(
        PrepareConfig(
            **inputs, out=str(out), encoder=EncoderSpec(weights="none"), min_count=1, batch_size=4, workers=0
        ),
        progress=False,
    )
    assert check_done_rows() == 48 and json.loads((out / "meta.json").read_text())["complete"]
    assert not temp_files(out)


# a full disk


# Where no tmpfs can be mounted, these tests (a failed save patched in) stand in for the real full disk.
PATCHED_SAVES = (
    "test_failed_periodic_save_is_retried_and_training_goes_on",
    "test_failed_final_save_raises_naming_the_last_good_checkpoint",
)


def test_the_tests_named_in_place_of_the_real_full_disk_exist():
    assert all(callable(globals().get(name)) for name in PATCHED_SAVES)


def _can_mount_tmpfs(where) -> bool:
    return (
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)], capture_output=True).returncode
        == 0
        and subprocess.run(["umount", str(where)], capture_output=True).returncode == 0
    )


@pytest.fixture
def small_tmpfs(tmp_path, whole):
    """A tmpfs holding two checkpoints of the FIT model and half of a third: the third save fails."""
    where = tmp_path / "disk"
    where.mkdir()
    if not _can_mount_tmpfs(where):
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN); {' and '.join(PATCHED_SAVES)} cover it")
    size = int(2.5 * os.path.getsize(whole / "last.pt")) + 64 * 1024  # + room for metrics.jsonl
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=True)
    yield where
    subprocess.run(["umount", str(where)], check=True)


@pytest.mark.slow
def test_full_disk_on_a_real_tmpfs_names_it_and_keeps_the_last_good_checkpoint(data_dir, small_tmpfs):
    out = small_tmpfs / "run"
    p = start("fit", "--data", str(data_dir), "--out", str(out), *FIT)
    assert p.wait() == 2
    err = p.stderr.read()
    assert "Traceback" not in err, err
    lines = [
        line for line in err.splitlines() if line.startswith(("warning:", "error:")) and "heatmaps" not in line
    ]  # not the attention-health warning of a tiny model
    first_epoch = [r for r in log_of(out) if r["event"] == "val"][0]["step"]
    # Epoch 2's saves fail and training goes on; epoch 3's final save fails and ends fit.
    assert lines[0].startswith(f"warning: cannot save {out}/")
    assert "no space left on the device holding" in lines[0] and "training goes on" in lines[0]
    assert lines[-1].startswith(f"error: cannot save {out}/last.pt at step")
    assert f"the last good checkpoint is {out}/last.pt at step {first_epoch}" in lines[-1]
    assert load_checkpoint(str(out / "last.pt"))["step"] == first_epoch
    assert not temp_files(out)


class _FullDisk:
    """A file on a disk with `free` bytes left: a write beyond them lands in part, then fails with ENOSPC,
    as write(2) does. (Python's file objects call write(2) directly, not os.write, so the file is patched.)"""

    def __init__(self, f, free: int):
        self.f, self.free = f, free

    def write(self, data) -> int:
        data = memoryview(data).cast("B")
        if len(data) > self.free:
            self.f.write(data[: self.free])
            self.free = 0
            raise OSError(errno.ENOSPC, "No space left on device")
        self.free -= len(data)
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def _failing_save(monkeypatch, fail) -> list[int]:
    """The n-th checkpoint save (its step recorded) meets a full disk, 3000 bytes in, when fail(n) is true.

    The real torch.save runs (so does save_checkpoint's recovery of the OSError behind torch's
    'unexpected pos'); only the temporary file it writes is on the "full" disk.
    """
    real_save, calls = torch.save, []

    def save(obj, f):
        calls.append(obj["step"])
        return real_save(obj, f)

    def open_(path, mode="r", *args, **kw):
        f = open(path, mode, *args, **kw)
        return _FullDisk(f, free=3000) if "w" in mode and fail(len(calls) + 1) else f

    monkeypatch.setattr(checkpoint.torch, "save", save)
    monkeypatch.setattr(checkpoint, "open", open_, raising=False)
    return calls


@pytest.mark.slow
def test_failed_periodic_save_is_retried_and_training_goes_on(data_dir, tmp_path, monkeypatch):
    calls = _failing_save(monkeypatch, lambda n: n == 2)
    out = tmp_path / "run"
    cfg = TrainConfig.of(epochs=1, batch_size=8, val_beam_size=1, checkpoint_every=4, checkpoint_minutes=0)
    progress = fit(FitJob(str(data_dir), str(out), TINY, cfg, device="cpu", progress_bar=False))
    failed = [r for r in log_of(out) if r["event"] == "save_failed"]
    assert len(failed) == 1 and failed[0]["step"] == calls[1] == 8
    assert "no space left" in failed[0]["message"] and "the last good checkpoint is" in failed[0]["message"]
    assert f"last.pt at step {calls[0]}" in failed[0]["message"]
    assert load_checkpoint(str(out / "last.pt"))["step"] == progress.step
    assert not temp_files(out)


@pytest.mark.slow
def test_failed_final_save_raises_naming_the_last_good_checkpoint(data_dir, tmp_path, monkeypatch):
    calls = _failing_save(monkeypatch, lambda n: n > 1)
    out = tmp_path / "run"
    cfg = TrainConfig.of(epochs=1, batch_size=8, val_beam_size=1, checkpoint_every=4, checkpoint_minutes=0)
    with pytest.raises(CaptionerError) as e:
        fit(FitJob(str(data_dir), str(out), TINY, cfg, device="cpu", progress_bar=False))
    message = str(e.value)
    assert "\n" not in message and "no space left on the device holding" in message
    assert f"the last good checkpoint is {out}/last.pt at step 4" in message and "--resume" in message
    assert calls[0] == 4 and load_checkpoint(str(out / "last.pt"))["step"] == 4
    assert not temp_files(out)


# damaged features, non-finite steps


@pytest.mark.slow
def test_damaged_feature_row_is_named_left_out_and_rechecked(scenes, data_dir, tmp_path, caplog):
    data = tmp_path / "data"
    shutil.copytree(data_dir, data)
    d = CaptionData(str(data))
    row = int(d.rows[0])  # an image with training captions
    image_id, path = d.meta["image_ids"][row], d.path_of(row)
    val_id, val_row = (int(v[0]) for v in d.split_images("val"))
    cache = np.load(data / "features.npy", mmap_mode="r+")
    cache[row, 3, 5] = np.inf
    cache[val_row, 0, 0] = np.nan  # beam search finds no caption at all for NaN features
    cache.flush()
    del cache, d
    out = tmp_path / "run"
    cfg = TrainConfig.of(epochs=2, batch_size=8, val_beam_size=1, checkpoint_minutes=0)
    caplog.set_level(logging.INFO, logger="captioner")
    progress = fit(FitJob(str(data), str(out), TINY, cfg, device="cpu", progress_bar=False))
    named = [
        r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "heatmaps" not in r.getMessage()
    ]
    assert len(named) == 2, named  # each image once, though met in every epoch
    assert f"image {image_id} ({path})" in named[0] and "left out of training" in named[0] and "--recheck" in named[0]
    assert f"image {val_id} (" in named[1] and "captioned from zeros" in named[1]
    captions = int((CaptionData(str(data)).rows == row).sum())
    assert progress.skipped_captions == 2 * captions and progress.skipped_steps == 0
    events = [r for r in log_of(out) if r["event"] == "damaged_features"]
    assert [(r["image_id"], r["row"]) for r in events] == [(image_id, row)]
    for name in ("last.pt", "best.pt"):
        assert all_finite(load_checkpoint(str(out / name)))
    # `prepare --recheck` finds the row, extracts it again, and the cache is whole.
    prepare_scenes(scenes, data, min_count=1, recheck=True)
    assert f"recheck: image {image_id} ({path})" in caplog.text and "recheck: 2 of 48 feature rows" in caplog.text
    repaired = np.load(data / "features.npy", mmap_mode="r")[[row, val_row]].astype(np.float32)
    reference = np.load(data_dir / "features.npy", mmap_mode="r")[[row, val_row]].astype(np.float32)
    np.testing.assert_allclose(repaired, reference, rtol=2e-3, atol=1e-3)


def test_nonfinite_rows_finds_inf_and_nan_in_fp16_and_fp32():
    x = np.random.default_rng(0).standard_normal((5, 7, 3)).astype(np.float16)
    x[1, 2, 0], x[3, 6, 2] = np.inf, np.nan
    x[4, 0, 0] = -65504.0  # the largest finite fp16 is not flagged
    assert features.nonfinite_rows(x).tolist() == [False, True, False, True, False]
    y = x.astype(np.float32)
    y[0, 0, 0] = -np.inf
    assert features.nonfinite_rows(y).tolist() == [True, True, False, True, False]
    assert features.nonfinite_rows(x[:0]).shape == (0,)


def test_a_step_with_a_nonfinite_loss_is_not_applied(data_dir):
    """Skipped on the device: the weights, Adam's moments and its step count stay as they were."""
    data = CaptionData(str(data_dir))
    torch.manual_seed(0)
    model = AttentionDecoder(vocab_size=len(data.vocab), embed_dim=16, hidden_dim=16, attention_dim=8)
    model.set_feature_stats(*data.feature_stats())
    step = train_step(model, TrainConfig.of(batch_size=4, lr=1e-2))
    batch = next(CaptionBatches(data, 4, view_share=0.25).batches(seed=0, epoch=0))
    batch.features[2, 0, 0] = float("nan")  # as if a damaged row got through
    before = {k: v.clone() for k, v in model.state_dict().items()}
    step(batch)
    terms, skipped = step.read()
    assert skipped == 1 and all(math.isnan(v) for v in terms.values())  # no step applied to average over
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(float(s["step"]) == 0 and not s["exp_avg"].any() for s in step.optimizer.state.values())
    batch.features[2, 0, 0] = 0.0
    step(batch)
    terms, skipped = step.read()
    assert skipped == 0 and all(math.isfinite(v) for v in terms.values())
    assert not all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_checkpoint_with_nonfinite_weights_is_never_written(tmp_path):
    from captioner.train.checkpoints import Checkpoints

    saver = Checkpoints(str(tmp_path), main=True, live=None, record={})
    saver.good[str(tmp_path / "last.pt")] = 7
    with pytest.raises(CaptionerError, match=r"not finite at step 9 \(w\).*last.pt at step 7"):
        saver.write({"step": 9, "model": {"w": torch.tensor([1.0, float("inf")])}}, str(tmp_path / "last.pt"))
    assert not os.listdir(tmp_path)
