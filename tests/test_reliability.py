"""Crash safety: `kill -9` during fit or prepare loses nothing finished and corrupts nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from conftest import REPO, SMALL_FIT, run_cli
from hypothesis import example, given, settings
from hypothesis import strategies as st

from captioner.io import write_json_atomic
from captioner.models.checkpoint import load_checkpoint
from captioner.models.decoder import DecoderConfig
from captioner.models.vocab import SPECIALS, Vocabulary, tokenize
from captioner.train.config import TrainConfig
from captioner.train.log import GracefulStop
from captioner.train.trainer import FitJob, fit

FIT = [
    "--epochs",
    "3",
    "--batch-size",
    "8",
    "--dropout",
    "0.3",
    "--checkpoint-every",
    "3",
    "--patience",
    "10",
    *SMALL_FIT,
]


def start(*args: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one thread: bit-for-bit the same arithmetic every run
    return subprocess.Popen(
        [sys.executable, "train.py", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for(predicate, proc: subprocess.Popen, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            pytest.fail(f"the process ended before {what}: {proc.stderr.read()[-2000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def saved_step(path) -> int:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)["step"]
    except Exception:
        return -1


@pytest.fixture(scope="module")
def uninterrupted(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("whole")
    p = start("fit", "--data", str(data_dir), "--out", str(out), *FIT)
    assert p.wait() == 0, p.stderr.read()
    return load_checkpoint(str(out / "last.pt"))


@pytest.mark.slow
@pytest.mark.parametrize("kill_after_step", [3, 9])
def test_fit_killed_then_resumed_equals_uninterrupted(data_dir, tmp_path, uninterrupted, kill_after_step):
    out = tmp_path / "run"
    p = start("fit", "--data", str(data_dir), "--out", str(out), *FIT)
    wait_for(lambda: saved_step(out / "last.pt") >= kill_after_step, p, f"a checkpoint at step {kill_after_step}")
    p.send_signal(signal.SIGKILL)
    p.wait()
    step = saved_step(out / "last.pt")
    assert step >= kill_after_step  # the last checkpoint is whole and loads
    r = start("fit", "--data", str(data_dir), "--out", str(out), *FIT, "--resume")
    assert r.wait() == 0, r.stderr.read()
    resumed = load_checkpoint(str(out / "last.pt"))
    log = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    starts = [r for r in log if r["event"] == "start"]
    assert starts[-1]["resume"] and starts[-1]["step"] == step > 0  # continued from the saved step, not 0
    assert resumed["step"] == uninterrupted["step"]
    for name, value in uninterrupted["model"].items():
        assert torch.equal(resumed["model"][name], value), name
    assert not [f for f in os.listdir(out) if ".tmp" in f]  # no half-written files left


@pytest.mark.slow
def test_a_write_removes_what_a_killed_writer_left_and_nothing_else(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphans = [f".best.pt.tmp{dead.pid}.pt", f".metrics.json.tmp{dead.pid}.json"]
    kept = [f".last.pt.tmp{os.getppid()}.pt", f"notes.tmp{dead.pid}.txt", f".data.tmp{dead.pid}.npy"]
    for name in orphans + kept:
        (tmp_path / name).write_bytes(b"half")
    write_json_atomic(str(tmp_path / "test.json"), {"ok": 1})
    assert sorted(os.listdir(tmp_path)) == sorted(kept + ["test.json"])


@pytest.mark.slow
def test_prepare_killed_then_rerun_completes_with_same_features(scenes, data_dir, tmp_path):
    out = tmp_path / "data"
    args = [
        "prepare",
        "--images",
        str(scenes / "images"),
        "--captions",
        str(scenes / "captions.json"),
        "--splits",
        str(scenes / "splits.json"),
        "--out",
        str(out),
        "--encoder-weights",
        "none",
        "--min-count",
        "1",
        "--batch-size",
        "4",
        "--workers",
        "0",
    ]
    p = start(*args)
    done = out / "features.done"
    wait_for(lambda: done.exists() and np.fromfile(done, np.uint8).sum() >= 8, p, "some extracted features")
    p.send_signal(signal.SIGKILL)
    p.wait()
    finished = int((np.fromfile(done, np.uint8) == 1).sum())
    assert 0 < finished < 48
    r = run_cli("train.py", *args)
    assert r.returncode == 0, r.stderr
    ours = np.load(out / "features.npy", mmap_mode="r")
    reference = np.load(data_dir / "features.npy", mmap_mode="r")
    np.testing.assert_allclose(ours.astype(np.float32), reference.astype(np.float32), rtol=2e-3, atol=1e-3)
    assert json.loads((out / "meta.json").read_text())["complete"]


@settings(max_examples=200, deadline=None)
@given(st.text())
@example("0'\r")  # found by hypothesis: a quote before a carriage return used to stay on the word
def test_tokenize_never_fails_and_gives_clean_tokens(text):
    tokens = tokenize(text)
    assert all(t and t == t.lower() and not t.isspace() and any(c.isalnum() for c in t) for t in tokens)
    assert tokenize(" ".join(tokens)) == tokens  # idempotent on its own output


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.lists(st.text(alphabet="abcdefg ", min_size=1, max_size=6).map(str.strip).filter(bool), max_size=8),
        max_size=12,
    ),
    st.integers(min_value=1, max_value=3),
)
def test_vocabulary_round_trip(sentences, min_count):
    vocab = Vocabulary.build(sentences, min_count=min_count)
    assert tuple(vocab.words[:4]) == SPECIALS
    for sentence in sentences:
        decoded = vocab.decode(vocab.encode(sentence))
        assert len(decoded) == len(sentence)
        assert all(d == w if w in vocab.index else d == "<unk>" for d, w in zip(decoded, sentence))


@pytest.mark.slow
def test_last_checkpoint_is_also_written_on_a_clock(data_dir, tmp_path, monkeypatch):
    """A run whose epochs outlast a kill still leaves last.pt: it is saved every checkpoint_minutes."""
    import captioner.train.checkpoints as checkpoints
    import captioner.train.trainer as training
    from captioner.models.decoder import DecoderConfig

    saved = []
    real = checkpoints.save_checkpoint  # fit saves through train.checkpoints.Checkpoints
    monkeypatch.setattr(
        checkpoints, "save_checkpoint", lambda ck, path: (saved.append((ck["step"], path)), real(ck, path))
    )
    cfg = training.TrainConfig.of(epochs=1, batch_size=8, val_beam_size=1, checkpoint_every=0, checkpoint_minutes=1e-6)
    small = DecoderConfig(0, embed_dim=16, hidden_dim=16, attention_dim=8)
    progress = training.fit(
        training.FitJob(str(data_dir), str(tmp_path / "run"), small, cfg, device="cpu", progress_bar=False)
    )
    mid_epoch = [step for step, path in saved if path.endswith("last.pt") and step < progress.step]
    assert len(mid_epoch) >= progress.step - 2  # about once per step at this setting, not only at the end
    assert load_checkpoint(str(tmp_path / "run" / "last.pt"))["step"] == progress.step


@pytest.mark.slow
def test_learning_rate_cools_down_at_the_end_of_the_time_budget_and_a_resume_starts_it_again(
    data_dir, tmp_path, monkeypatch
):
    """On a clock that moves one second per step, a 12-second budget with cooldown 0.5 trains its
    first 6 steps at the full rate, then falls linearly towards 0; resumed with a new budget, the
    run starts again from the full rate, not from the cooled one its last.pt holds."""
    import captioner.train.trainer as training
    from captioner.models.decoder import DecoderConfig
    from captioner.train.step import TrainStep

    now = [0.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    rates = []
    real_step = TrainStep.__call__

    def step(self, batch):
        rates.append(float(self.optimizer.param_groups[0]["lr"]))
        now[0] += 1.0
        return real_step(self, batch)

    monkeypatch.setattr(TrainStep, "__call__", step)
    cfg = training.TrainConfig.of(epochs=5, batch_size=8, val_beam_size=1, lr=1e-3, max_minutes=0.2, cooldown=0.5)
    small = DecoderConfig(0, embed_dim=16, hidden_dim=16, attention_dim=8)
    training.fit(training.FitJob(str(data_dir), str(tmp_path / "run"), small, cfg, device="cpu", progress_bar=False))
    assert len(rates) == 13  # the step that crosses 12 s is the last
    assert rates[:7] == [1e-3] * 7  # 0-6 s elapsed: before the cooldown
    assert rates[7:] == pytest.approx([1e-3 * (12 - t) / 6 for t in range(7, 13)])
    assert rates[-1] == 0.0

    rates.clear()
    training.fit(
        training.FitJob(str(data_dir), str(tmp_path / "run"), small, cfg, resume=True, device="cpu", progress_bar=False)
    )
    assert rates[0] == 1e-3


class _StopAfter(GracefulStop):
    """SIGTERM as `fit` sees it, asked for once `steps` training steps are done (fit looks after each)."""

    def __init__(self, steps: int):
        super().__init__(announce=False)
        self.steps, self.looks = steps, 0

    @property
    def requested(self) -> bool:
        self.looks += 1
        if self.looks >= self.steps:
            self.request()
        return self.signum is not None


def test_fit_stopped_mid_epoch_then_resumed_equals_uninterrupted(data_dir, tmp_path):
    """In process, the fast twin of the kill tests above: a run stopped after 5 steps of its first
    epoch and resumed ends where a run never stopped ends, bit for bit: weights, Adam's moments, the
    random streams (dropout) and the step, having replayed the rest of the epoch's batches."""
    model = DecoderConfig(0, embed_dim=16, hidden_dim=16, attention_dim=8, dropout=0.3)
    cfg = TrainConfig.of(
        epochs=2, batch_size=16, val_beam_size=1, val_images=4, checkpoint_every=0, checkpoint_minutes=0
    )
    run = lambda out, stop=None, **kw: fit(
        FitJob(str(data_dir), str(tmp_path / out), model, cfg, device="cpu", progress_bar=False, **kw), stop
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: a second thread only waits, and on a busy machine that is slow
    try:
        whole = run("whole")
        stopped = run("run", stop=_StopAfter(5))
        assert stopped.step == 5 and stopped.epoch == 0 and whole.step > 5 + stopped.batch_in_epoch
        resumed = run("run", resume=True)
    finally:
        torch.set_num_threads(threads)
    assert resumed.step == whole.step and resumed.epoch == whole.epoch == 2
    a, b = (load_checkpoint(str(tmp_path / out / "last.pt")) for out in ("whole", "run"))
    assert a["step"] == b["step"] and a["model"].keys() == b["model"].keys()
    for name, value in a["model"].items():
        assert torch.equal(b["model"][name], value), name
    for k, state in a["optimizer"]["state"].items():
        for name, value in state.items():
            assert torch.equal(torch.as_tensor(b["optimizer"]["state"][k][name]), torch.as_tensor(value)), (k, name)
    assert torch.equal(a["rng"]["generator"], b["rng"]["generator"]) and a["metrics"]["CIDEr"] == b["metrics"]["CIDEr"]
