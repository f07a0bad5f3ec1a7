"""The compiled training step and search (`captioner.compiled`), where a CPU can show them.

A GPU compiles them with `torch.compile(mode="reduce-overhead")` and replays them as CUDA graphs; a CPU
compiles the same functions in the default mode (`fit --compile`, `beam_search(compiled=True)`), so
what the compiler specialises to, its guards, and what happens when it fails are checked here. Tests
of the plumbing alone put an identity in `torch.compile`'s place; those marked slow compile for real.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

import captioner.train.parts as parts_module
from captioner.cli import selfcheck
from captioner.compiled import FELL_BACK, GRAPHS, Compiled
from captioner.decoding.decode import beam_search
from captioner.decoding.search_state import compiled_block
from captioner.models.decoder import AttentionDecoder, DecoderConfig
from captioner.train.config import OptimConfig, TrainConfig
from captioner.train.loop import fit
from captioner.train.parts import step_compiling

SMALL = DecoderConfig(0, embed_dim=16, hidden_dim=24, attention_dim=12, dropout=0.0)
CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a device named, not used: the decision alone


@pytest.fixture
def fresh_search():
    """The process's compiled search, made anew for this test and after it."""
    compiled_block.cache_clear()
    yield
    compiled_block.cache_clear()


def identity(monkeypatch):
    """`torch.compile` as the identity: the compiled paths' plumbing, without compiling."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)


def broken(monkeypatch):
    """`torch.compile` whose functions fail as a compiler error would, at their first call."""

    def compile(fn, **kw):
        def failing(*args, **kwargs):
            raise RuntimeError("injected compile failure\nwith a long trace after it")

        return failing

    monkeypatch.setattr(torch, "compile", compile)


def tiny_decoder(seed: int = 0) -> AttentionDecoder:
    """A random decoder, which seldom writes <end>: its captions run to the longest allowed."""
    torch.manual_seed(seed)
    return AttentionDecoder(vocab_size=40, embed_dim=32, hidden_dim=32, attention_dim=32).eval()


def same_search(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        assert [h.tokens for h in x] == [h.tokens for h in y]
        assert [h.ended for h in x] == [h.ended for h in y]
        for h, g in zip(x, y):
            assert h.score == pytest.approx(g.score, abs=1e-4)
            np.testing.assert_allclose(h.attention, g.attention, atol=1e-5)


def _fit(data_dir, out, **settings):
    base = dict(epochs=1, batch_size=8, lr=3e-3, val_beam_size=1, val_images=4, log_every=1, seed=3, consistency=0)
    cfg = TrainConfig.of(**base | settings)
    fit(str(data_dir), str(out), SMALL, cfg, device="cpu", progress_bar=False, resume=(out / "last.pt").exists())
    return [json.loads(x) for x in open(out / "metrics.jsonl", encoding="utf-8")]


def _losses(lines):
    return [(x["step"], x["loss"]) for x in lines if x["event"] == "train"]


# which steps compile


def test_a_gpu_compiles_with_graphs_unless_they_are_off_and_a_cpu_only_when_asked():
    assert step_compiling(OptimConfig(), CUDA) == GRAPHS
    assert step_compiling(OptimConfig(cuda_graphs="off"), CUDA) is None
    assert step_compiling(OptimConfig(cuda_graphs="off", compile=True), CUDA) == "default"
    assert step_compiling(OptimConfig(), CPU) is None
    assert step_compiling(OptimConfig(compile=True), CPU) == "default"


def test_a_run_resumed_with_cuda_graphs_off_steps_without_them(data_dir, tmp_path, monkeypatch):
    """`fit --resume --cuda-graphs off` of a run that compiled its steps with graphs: its steps are eager."""
    identity(monkeypatch)
    made = []

    def on_a_gpu(optim, device):  # the decision a GPU makes, for this CPU run
        made.append(step_compiling(optim, CUDA))
        return made[-1]

    monkeypatch.setattr(parts_module, "step_compiling", on_a_gpu)
    run = tmp_path / "run"
    _fit(data_dir, run)
    _fit(data_dir, run, epochs=2, cuda_graphs="off")
    assert made == [GRAPHS, None]


# the training step


def test_the_compiled_steps_plumbing_trains_as_eager_steps_do(data_dir, tmp_path, monkeypatch):
    """The compiled path (its forward drawing from the default generator, its rates as tensors, its update
    apart) with nothing to draw: the losses of eager steps, step for step."""
    eager = _losses(_fit(data_dir, tmp_path / "eager", shapes="fixed"))
    identity(monkeypatch)
    compiled = _losses(_fit(data_dir, tmp_path / "compiled", compile=True))
    assert [s for s, _ in compiled] == [s for s, _ in eager]
    assert [v for _, v in compiled] == pytest.approx([v for _, v in eager], rel=1e-5, abs=1e-6)


def test_a_step_that_fails_to_compile_trains_eagerly_and_says_so_once(data_dir, tmp_path, monkeypatch):
    eager = _losses(_fit(data_dir, tmp_path / "eager", shapes="fixed"))
    broken(monkeypatch)
    lines = _fit(data_dir, tmp_path / "broken", compile=True)
    assert [s for s, _ in _losses(lines)] == [s for s, _ in eager]
    assert [v for _, v in _losses(lines)] == pytest.approx([v for _, v in eager], rel=1e-5, abs=1e-6)
    failed = [x["message"] for x in lines if x["event"] == "compiled_failed"]
    assert len(failed) == 2  # the forward and backward, and the update: once each
    assert all(m.startswith(FELL_BACK) and "injected compile failure" in m and "trace" not in m for m in failed)
    assert any("the training step's forward and backward" in m for m in failed)
    with pytest.raises(RuntimeError, match="injected compile failure"):
        selfcheck._compile_failures(str(tmp_path / "broken"))


def test_a_learning_rate_set_as_a_float_reaches_the_compiled_step(data_dir, monkeypatch):
    """A schedule that assigns a float (ReduceLROnPlateau on some torch versions, the cooldown, a resumed
    run's saved rates) changes the tensor the compiled step reads, which stays the same object: a new
    float would otherwise be a new constant, and a recompile."""
    from conftest import train_step

    from captioner.data.batches import CaptionBatches, FixedShapes
    from captioner.data.dataset import CaptionData

    identity(monkeypatch)
    data = CaptionData(str(data_dir))
    dec = AttentionDecoder(vocab_size=len(data.vocab), embed_dim=16, hidden_dim=24, attention_dim=12)
    dec.set_feature_stats(*data.feature_stats())
    step = train_step(dec, TrainConfig.of(shapes="fixed", consistency=0), compiled="default")
    rate = step.optimizer.param_groups[0]["lr"]
    assert torch.is_tensor(rate)
    fixed = FixedShapes.for_data(8, int(data.lengths.max()))
    batch = next(iter(CaptionBatches(data, 8, fixed=fixed).batches(seed=0, epoch=0)))
    step(batch)
    step.optimizer.param_groups[0]["lr"] = 2.5e-4  # as a float
    step(batch)
    assert step.optimizer.param_groups[0]["lr"] is rate
    assert float(rate) == pytest.approx(2.5e-4)


def traced(monkeypatch):
    """`torch.compile` that traces, guards and differentiates as it does (Dynamo and AOTAutograd), and runs the
    traced graphs without generating code: Inductor's code generation, the CPU's minute per length bucket
    here, is the selfcheck's `compile` row's, which compiles as users do."""
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, mode=None, **kw: real(fn, backend="aot_eager", **kw))


@pytest.mark.slow
def test_a_compiled_step_trains_as_the_eager_one_and_its_log_says_what_compiled(data_dir, tmp_path, monkeypatch):
    """`fit --compile` on the CPU, traced whole (one trace per length bucket): the eager steps' losses where
    nothing is drawn, and each compile in the log with its time."""
    eager = _losses(_fit(data_dir, tmp_path / "eager", shapes="fixed"))
    traced(monkeypatch)
    lines = _fit(data_dir, tmp_path / "compiled", compile=True)
    assert [v for _, v in _losses(lines)] == pytest.approx([v for _, v in eager], rel=1e-4, abs=1e-5)
    compiled = [x["message"] for x in lines if x["event"] == "compiled"]
    assert any("the training step's forward and backward" in m for m in compiled)
    assert any("the training step's update" in m for m in compiled)
    assert not [x for x in lines if x["event"] == "compiled_failed"]


@pytest.mark.slow
def test_recompiles_past_the_limit_fall_back_with_a_warning(caplog):
    doubled = Compiled(lambda x: x * 2, "a doubling", mode="default", limit=1)
    assert torch.equal(doubled(torch.ones(2)), torch.full((2,), 2.0))
    with caplog.at_level(logging.WARNING):
        assert torch.equal(doubled(torch.ones(3)), torch.full((3,), 2.0))  # another shape: a second compile
    assert doubled.failed and [r.getMessage() for r in caplog.records if FELL_BACK in r.getMessage()]


# the search


@pytest.mark.slow
def test_a_search_at_one_length_then_another_gives_each_its_own_captions(fresh_search):
    """max_len 20, then 21, then 5: each request its own captions (cut at its own length), equal to the
    eager search's. The compiled block reads the length as a tensor, so none of them compiles again."""
    decoder, feats = tiny_decoder(), torch.randn(2, 196, 512)
    for max_len in (20, 21, 5):
        got = beam_search(decoder, feats, beam_size=3, max_len=max_len, shapes="fixed", compiled=True)
        want = beam_search(decoder, feats, beam_size=3, max_len=max_len, shapes="fixed", compiled=False)
        same_search(got, want)
        assert max(len(h.tokens) for hyps in got for h in hyps) == max_len
    assert compiled_block("default").failed is None


def test_a_search_that_fails_to_compile_goes_on_eagerly_and_says_so_once(fresh_search, monkeypatch, caplog):
    broken(monkeypatch)
    decoder, feats = tiny_decoder(), torch.randn(2, 196, 512)
    want = beam_search(decoder, feats, beam_size=2, max_len=6, shapes="fixed", compiled=False)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            same_search(beam_search(decoder, feats, beam_size=2, max_len=6, shapes="fixed", compiled=True), want)
    said = [r.getMessage() for r in caplog.records if FELL_BACK in r.getMessage()]
    assert len(said) == 1 and "the search's block of steps" in said[0] and "injected" in said[0]


def test_a_server_whose_compile_fails_answers_every_request_eagerly(fresh_search, monkeypatch):
    """The demo's batcher over a model whose search fails to compile: the request that met the failure and
    every later one get the captions of an eager search."""
    from captioner.serve.api import Captioner
    from captioner.serve.batcher import Batcher
    from captioner.serve.sources import demo_model, example_images

    cap = Captioner.load(demo_model())
    want = [c.text for c in cap.caption_batch(example_images()[:3])]
    broken(monkeypatch)
    cap.compiling = True  # as `compile_search` makes it on a GPU
    batcher = Batcher(cap)
    try:
        got = [batcher.caption(im).text for im in example_images()[:3]]
    finally:
        batcher.close()
    assert got == want
    assert compiled_block("default").failed


def test_batches_of_any_size_share_a_few_search_shapes():
    """The demo's batcher makes batches of 1 to 8 images: padded to powers of two, they need four compiled
    shapes, not eight, and the real images' captions are those of the batch unpadded."""
    from captioner.serve.api import _padded

    decoder, feats = tiny_decoder(), torch.randn(5, 196, 512)
    assert {_padded(feats[:b]).size(0) for b in range(1, 9)} == {1, 2, 4, 8}
    with torch.inference_mode():
        plain = beam_search(decoder, feats, beam_size=2, max_len=6, shapes="fixed", compiled=False)
        padded = beam_search(decoder, _padded(feats), beam_size=2, max_len=6, shapes="fixed", compiled=False)[:5]
    assert [[h.tokens for h in b] for b in padded] == [[h.tokens for h in b] for b in plain]


def test_selfcheck_fails_a_mode_in_which_a_compiled_function_fell_back(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        json.dumps({"event": "start"}) + "\n" + json.dumps({"event": "compiled_failed", "message": "the update"}) + "\n"
    )
    with pytest.raises(RuntimeError, match="the update"):
        selfcheck._compile_failures(str(tmp_path))
    with open(tmp_path / "log", "w") as log, pytest.raises(RuntimeError, match="fell back: the search"):
        selfcheck._run(["python", "-c", f"print('warning: {FELL_BACK}: the search x')"], log)


def test_a_compiler_error_is_said_in_one_line():
    from captioner.compiled import first_line

    error = RuntimeError("backend='inductor' raised:\nCalledProcessError: ...\n\nSet TORCHDYNAMO_VERBOSE=1\n")
    assert first_line(error) == "RuntimeError: backend='inductor' raised:"


def test_a_validation_that_fails_leaves_its_epoch_to_validate_on_resume(data_dir, tmp_path, monkeypatch):
    """A failure inside validation (a search that broke, an out-of-memory) saves last.pt with the epoch's
    steps, not counting the epoch: `fit --resume` validates it before it goes on."""
    import captioner.train.loop as loop_module
    from captioner.models.checkpoint import load_checkpoint

    validate = loop_module.validate

    def breaks(*args, **kwargs):
        raise RuntimeError("injected failure during validation")

    monkeypatch.setattr(loop_module, "validate", breaks)
    run = tmp_path / "run"
    with pytest.raises(RuntimeError, match="during validation"):
        _fit(data_dir, run, epochs=2)
    progress = load_checkpoint(str(run / "last.pt"))["progress"]
    assert progress["epoch"] == 0 and progress["batch_in_epoch"] == progress["step"] > 0
    monkeypatch.setattr(loop_module, "validate", validate)
    lines = _fit(data_dir, run, epochs=2)
    resumed = lines[max(i for i, x in enumerate(lines) if x["event"] == "start") :]
    assert [x["epoch"] for x in resumed if x["event"] == "val"] == [1, 2]
    assert [x["step"] for x in resumed if x["event"] == "train"][0] > progress["step"]  # no step trained twice
