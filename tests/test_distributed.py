"""torchrun: 2 CPU processes (gloo) train like 1 process at the same global batch."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import SMALL_FIT, prepare_scenes, run_cli

from captioner import Captioner
from captioner.compiled import FELL_BACK
from captioner.models.checkpoint import load_checkpoint
from captioner.models.encoder import EncoderSpec

pytestmark = pytest.mark.slow  # end to end: trains, serves or runs notebooks

TINY = [
    "--epochs",
    "1",
    "--dropout",
    "0",
    "--log-every",
    "1",
    *SMALL_FIT,
]


def torchrun(*args: str, env: dict | None = None):
    """`torchrun --standalone --nproc-per-node 2 ...` (the same launcher, run as a module)."""
    return run_cli(
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        *args,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )


def train_losses(run) -> list[float]:
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in lines if r["event"] == "train"]


def test_two_processes_match_one(data_dir, scenes, tmp_path):
    """Bit for bit without the view consistency: its draws (which captions, which step) come from
    each process's own generator, so with it on, two processes match one in distribution only."""
    one, two = tmp_path / "one", tmp_path / "two"
    tiny = [*TINY, "--consistency", "0"]
    p = run_cli(
        "train.py",
        "fit",
        "--data",
        str(data_dir),
        "--out",
        str(one),
        "--batch-size",
        "8",
        *tiny,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert p.returncode == 0, p.stderr[-2000:]
    p = torchrun("train.py", "fit", "--data", str(data_dir), "--out", str(two), "--batch-size", "4", *tiny)
    assert p.returncode == 0, p.stderr[-3000:]
    a, b = train_losses(one), train_losses(two)
    assert len(a) == len(b) >= 10
    assert b == pytest.approx(a, rel=1e-5)  # same batches, same gradients, same updates
    # Rank 0 wrote the checkpoints, and they load and caption.
    cap = Captioner.load(str(two / "best.pt"))
    image = sorted((scenes / "images").iterdir())[0]
    assert cap.caption(image, beam_size=2).attention.shape[1:] == (14, 14)


@pytest.fixture(scope="module")
def one_length_bucket(scenes, tmp_path_factory) -> Path:
    """The scenes with each caption cut to its first six words, prepared at 112 px without views: every
    batch pads to the same length bucket, so a compiled step compiles one graph, not one a bucket."""
    out = tmp_path_factory.mktemp("one_bucket")
    coco = json.loads((scenes / "captions.json").read_text())
    for a in coco["annotations"]:
        a["caption"] = " ".join(a["caption"].split()[:6])
    (out / "captions.json").write_text(json.dumps(coco))
    for name in ("images", "splits.json"):
        (out / name).symlink_to(scenes / name)
    prepare_scenes(out, out / "data", encoder=EncoderSpec(weights="none", image_size=112), views=False)
    return out / "data"


COUNTS = """
import atexit, json, os
if os.environ.get("RANK") is not None:
    def counts():
        from torch._dynamo.utils import counters

        seen = {"graphs": counters["stats"]["unique_graphs"], "compiled": counters["aot_autograd"]["total"]}
        with open(os.path.join(os.environ["COUNTS_DIR"], os.environ["RANK"]), "w") as f:
            json.dump(seen, f)

    atexit.register(counts)
"""


def test_two_processes_compile_their_steps_as_pytorch_documents(one_length_bucket, tmp_path):
    """`torchrun ... fit --compile`: each process's objective compiles inside DDP with nothing fallen back, as one
    graph that the compiler's DDPOptimizer splits at DDP's gradient buckets (a decoder of about 10 MB: more than
    DDP's first bucket of 1 MB), and trains as the eager processes do (nothing is drawn: no dropout, no views)."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(COUNTS)
    runs = {}
    data = str(one_length_bucket)
    for how in ("eager", "compiled"):
        runs[how] = tmp_path / how
        tiny = [*TINY, "--consistency", "0", "--shapes", "fixed", *(["--compile"] if how == "compiled" else [])]
        wide = ["--embed-dim", "128", "--hidden-dim", "512", "--attention-dim", "256"]
        env = {"PYTHONPATH": str(tmp_path / "site"), "COUNTS_DIR": str(tmp_path)}
        fit = ["train.py", "fit", "--data", data, "--out", str(runs[how]), "--batch-size", "4", *tiny, *wide]
        p = torchrun(*fit, env=env)
        assert p.returncode == 0, p.stderr[-3000:]
        assert FELL_BACK not in p.stderr  # every rank's warnings: the log below is rank 0's
    lines = [json.loads(x) for x in (runs["compiled"] / "metrics.jsonl").read_text().splitlines()]
    assert len([x for x in lines if x["event"] == "compiled"]) == 1  # rank 0's record: one graph, one bucket
    assert not [x for x in lines if x["event"] == "compiled_failed"]
    counts = [json.loads((tmp_path / rank).read_text()) for rank in ("0", "1")]
    assert counts[0] == counts[1] and counts[0]["graphs"] == 1 and counts[0]["compiled"] >= 2, counts
    assert train_losses(runs["compiled"]) == pytest.approx(train_losses(runs["eager"]), rel=1e-4)


def test_two_processes_resumed_go_on_each_with_its_own_random_streams(data_dir, tmp_path):
    """Resumed after its first epoch, a 2-process run ends where the run never stopped ends, bit for bit:
    each rank goes on with its own streams (hard attention's sampled locations, dropout), not rank 0's."""
    whole, run = tmp_path / "whole", tmp_path / "run"
    tiny = [*TINY, "--attention", "hard", "--dropout", "0.3", "--checkpoint-minutes", "0", "--batch-size", "4"]

    def fit(out, epochs: str, *extra: str):
        return torchrun(
            "train.py", "fit", "--data", str(data_dir), "--out", str(out), *tiny, "--epochs", epochs, *extra
        )

    for p in (fit(whole, "2"), fit(run, "1"), fit(run, "2", "--resume")):
        assert p.returncode == 0, p.stderr[-3000:]
    a, b = (load_checkpoint(str(out / "last.pt")) for out in (whole, run))
    assert a["step"] == b["step"] and train_losses(run)[-1] == train_losses(whole)[-1]
    for name, value in a["model"].items():
        assert torch.equal(b["model"][name], value), name
    # Rank 1's streams, kept beside last.pt, are its own and those of the run never stopped.
    ranks = [torch.load(out / "last.rank1.rng.pt", weights_only=True)["rng"] for out in (whole, run)]
    assert torch.equal(ranks[0]["generator"], ranks[1]["generator"])
    assert not torch.equal(ranks[0]["generator"], a["rng"]["generator"])


CLOCKS = """
import os
if os.environ.get("RANK") is not None:
    from captioner.train import checkpoints, trainer

    rank = int(os.environ["RANK"])
    if rank == 1:  # a clock that stands still: never a minute since the last save
        trainer.time = type("Clock", (), {"monotonic": staticmethod(lambda: 0.0)})
    save = checkpoints.Checkpoints.save

    def recorded(self, path, progress, metrics, *, final=False):
        if path == self.last_path:
            with open(os.path.join(os.environ["SAVES_DIR"], f"rank{rank}"), "a") as f:
                f.write(f"{progress.step}\\n")
        return save(self, path, progress, metrics, final=final)

    checkpoints.Checkpoints.save = recorded
"""


def test_ranks_whose_clocks_differ_save_at_the_same_steps(data_dir, tmp_path):
    """`--checkpoint-minutes` under torchrun: rank 0's last.pt and rank 1's streams beside it are of one step,
    though rank 1's clock stands still (a sitecustomize sets it, and records each rank's saves)."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(CLOCKS)
    saves = tmp_path / "saves"
    saves.mkdir()
    fit = ["train.py", "fit", "--data", str(data_dir), "--out", str(tmp_path / "run"), *TINY, "--log-every", "2"]
    env = {"PYTHONPATH": str(tmp_path / "site"), "SAVES_DIR": str(saves)}
    p = torchrun(*fit, "--checkpoint-minutes", "0.0001", "--batch-size", "4", env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    steps = [(saves / f"rank{r}").read_text().split() for r in (0, 1)]
    assert len(steps[0]) > 2 and steps[0] == steps[1]


def test_distributed_prepare_fills_one_cache(scenes, data_dir, tmp_path):
    out = tmp_path / "data"
    p = torchrun(
        "train.py",
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
        "--workers",
        "0",
    )
    assert p.returncode == 0, p.stderr[-3000:]
    import numpy as np

    ours = np.load(out / "features.npy", mmap_mode="r").astype(np.float32)
    ref = np.load(data_dir / "features.npy", mmap_mode="r").astype(np.float32)
    np.testing.assert_allclose(ours, ref, rtol=2e-3, atol=1e-3)
    for name in ("vocab.json", "splits.json"):
        assert json.loads((out / name).read_text()) == json.loads((data_dir / name).read_text())


FIRST_STEP = """
import json, os
if os.environ.get("RANK") is not None:
    import torch._inductor.config
    from captioner.train import step

    torch._inductor.config.fallback_random = True  # compiled code draws as eager code does, from the same stream
    call, seen = step.TrainStep.__call__, []

    def first(self, batch):
        call(self, batch)
        if not seen:  # this rank's own sums, before any is reduced across ranks
            seen.append({k: float(v) for k, v in self.sums.items()})
            with open(os.path.join(os.environ["SEEN_DIR"], os.environ["RANK"]), "w") as f:
                json.dump(seen[0], f)

    step.TrainStep.__call__ = first
"""


@pytest.fixture(scope="module")
def one_scene(scenes, tmp_path_factory) -> Path:
    """Every image the same picture, every caption the same words: each rank's first batch is the same."""
    out = tmp_path_factory.mktemp("one_scene")
    coco = json.loads((scenes / "captions.json").read_text())
    first = sorted((scenes / "images").iterdir())[0]
    (out / "images").mkdir()
    for image in coco["images"]:
        (out / "images" / image["file_name"]).symlink_to(first)
    for a in coco["annotations"]:
        a["caption"] = "a red circle on a gray background"
    (out / "captions.json").write_text(json.dumps(coco))
    (out / "splits.json").symlink_to(scenes / "splits.json")
    prepare_scenes(out, out / "data", encoder=EncoderSpec(weights="none", image_size=112), views=False)
    return out / "data"


def test_each_rank_draws_its_own_dropout_masks_compiled_or_not(one_scene, tmp_path):
    """Two ranks on the same batch with dropout: their first step's losses differ (their masks differ), and a
    compiled rank's equals its eager run's (it draws the same masks from the same stream)."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(FIRST_STEP)
    sums = {}
    for how in ("eager", "compiled"):
        seen = tmp_path / how
        seen.mkdir()
        tiny = [*TINY, "--dropout", "0.5", "--consistency", "0", "--shapes", "fixed", "--batch-size", "4"]
        fit = ["train.py", "fit", "--data", str(one_scene), "--out", str(seen / "run"), *tiny]
        compiling = ["--compile"] if how == "compiled" else []
        p = torchrun(*fit, *compiling, env={"PYTHONPATH": str(tmp_path / "site"), "SEEN_DIR": str(seen)})
        assert p.returncode == 0, p.stderr
        sums[how] = [json.loads((seen / rank).read_text())["nll"] for rank in ("0", "1")]
    assert sums["eager"][0] != pytest.approx(sums["eager"][1], rel=1e-3)
    assert sums["compiled"] == pytest.approx(sums["eager"], rel=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the searches compile there")
def test_scsts_greedy_baseline_compiles_under_ddp_as_in_one_process(data_dir, small_run, tmp_path):
    """SCST's greedy baseline is searched outside DDP's forward, so DDPOptimizer does not cut the compiled search:
    a rank of two compiles what one process alone compiles, at the same batch per process."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(COUNTS)
    counts = {}
    for processes, batch in (("1", "4"), ("2", "8")):
        out = tmp_path / processes
        out.mkdir()
        fit = ["train.py", "fit", "--data", str(data_dir), "--out", str(out / "run"), "--val-beam-size", "1"]
        scst = ["--init", str(small_run / "best.pt"), "--objective", "scst", "--scst-baseline", "greedy"]
        p = run_cli(
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            processes,
            *fit,
            *scst,
            "--epochs",
            "1",
            "--batch-size",
            batch,
            env={**os.environ, "PYTHONPATH": str(tmp_path / "site"), "COUNTS_DIR": str(out)},
        )
        assert p.returncode == 0, p.stderr[-3000:]
        assert FELL_BACK not in p.stderr
        counts[processes] = json.loads((out / "0").read_text())
    assert counts["2"] == counts["1"], counts
