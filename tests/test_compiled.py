"""The compiled training step and search (`captioner.compiled`), with PyTorch's own compiler.

A GPU compiles them with `torch.compile(mode="reduce-overhead")` and replays them as CUDA graphs; a CPU
compiles the same functions with Inductor in the default mode (`fit --compile`), so what the compiler
specialises to, its guards, what it refuses and what happens then are checked here with the real
compiler, nothing stubbed. A fallback to eager where none is asked for fails a test. The tests that
generate and build code (tens of seconds each on two cores) are marked slow; those whose compile the
compiler refuses while tracing, or of a one-line function, run in the quick tier.
"""

from __future__ import annotations

import json
import logging
import re
import threading

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

import captioner.train.setup as train_setup
from captioner.cli import selfcheck
from captioner.compiled import FELL_BACK, GRAPHS, Compiled
from captioner.decoding.decode import beam_search
from captioner.decoding.search_state import compiled_block
from captioner.models.decoder import AttentionDecoder, DecoderConfig
from captioner.objectives.objective import CrossEntropy
from captioner.train.config import ProcessConfig, TrainConfig
from captioner.train.setup import step_compiling
from captioner.train.trainer import FitJob, fit

SMALL = DecoderConfig(0, embed_dim=16, hidden_dim=24, attention_dim=12, dropout=0.0)
CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a device named, not used: the decision alone
ON_A_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@pytest.fixture
def fresh_search():
    """The process's compiled search, made anew for this test and after it (and what the compiler keeps of it)."""
    compiled_block.cache_clear()
    torch._dynamo.reset()
    yield
    compiled_block.cache_clear()
    torch._dynamo.reset()


def graphs_compiled() -> int:
    return counters["stats"]["unique_graphs"]


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


def _fit(data_dir, out, device="cpu", **settings):
    base = dict(epochs=1, batch_size=8, lr=3e-3, val_beam_size=1, val_images=4, log_every=1, seed=3, consistency=0)
    cfg = TrainConfig.of(**base | settings)
    resume = (out / "last.pt").exists()
    fit(FitJob(str(data_dir), str(out), SMALL, cfg, device=device, progress_bar=False, resume=resume))
    return [json.loads(x) for x in open(out / "metrics.jsonl", encoding="utf-8")]


def _losses(lines):
    return [(x["step"], x["loss"]) for x in lines if x["event"] == "train"]


def graph_break_in_the_cross_entropy(monkeypatch):
    """The cross-entropy term breaks the graph where the step must compile whole: a real refusal of the
    compiler (eagerly, `torch._dynamo.graph_break()` does nothing)."""
    value = CrossEntropy.__call__

    def breaking(self, ctx):
        torch._dynamo.graph_break()
        return value(self, ctx)

    monkeypatch.setattr(CrossEntropy, "__call__", breaking)


# which steps compile


def test_a_gpu_compiles_with_graphs_unless_they_are_off_and_a_cpu_only_when_asked():
    assert step_compiling(ProcessConfig(), CUDA) == GRAPHS
    assert step_compiling(ProcessConfig(cuda_graphs="off"), CUDA) is None
    assert step_compiling(ProcessConfig(cuda_graphs="off", compile=True), CUDA) == "default"
    assert step_compiling(ProcessConfig(), CPU) is None
    assert step_compiling(ProcessConfig(compile=True), CPU) == "default"


def test_a_run_resumed_with_cuda_graphs_off_decides_on_eager_steps(data_dir, tmp_path, monkeypatch):
    """`fit --resume --cuda-graphs off` of a run that compiled its steps with graphs: its steps are eager
    (the decision a GPU makes is recorded; this CPU steps eagerly both times)."""
    made = []

    def on_a_gpu(optim, device):
        made.append(step_compiling(optim, CUDA))
        return None

    monkeypatch.setattr(train_setup, "step_compiling", on_a_gpu)
    run = tmp_path / "run"
    _fit(data_dir, run)
    _fit(data_dir, run, epochs=2, cuda_graphs="off")
    assert made == [GRAPHS, None]


# The torch releases the whole suite has run on (CI, and the sessions' machines), with the compiler settings
# `Compiled` sets: pyproject.toml's floor is one of them.
RUN_ON = {(2, 14): "2.14.1, CI and the development machines", (2, 15): "2.15.0, some development machines"}


def test_the_torch_floor_is_a_release_that_runs_here():
    """pyproject.toml's lowest torch is one the tests have run on, at most the one they run on now, and this
    one has what `Compiled` sets."""
    from conftest import REPO

    floor = tuple(map(int, re.search(r'"torch>=(\d+)\.(\d+)', (REPO / "pyproject.toml").read_text()).groups()))
    assert floor in RUN_ON and floor <= tuple(map(int, torch.__version__.split(".")[:2]))
    assert {"recompile_limit", "fail_on_recompile_limit_hit"} <= set(torch._dynamo.config._config)


def test_searches_compile_only_where_their_caller_asks():
    """A search compiles where its caller decided it earns back its compile (a GPU's server, validation,
    evaluation of a whole split, SCST's baseline), never by default because its features are on a GPU."""
    import inspect

    from captioner.decoding.decode import decode
    from captioner.evaluation.metrics import caption_split
    from captioner.objectives.scst import greedy_tokens

    for fn in (beam_search, decode, caption_split, greedy_tokens):
        assert inspect.signature(fn).parameters["compiled"].default is False, fn.__name__


def test_no_test_stands_in_for_the_compiler():
    """Compiled code is tested with PyTorch's own compiler: no test replaces `torch.compile` or its backend."""
    from conftest import REPO

    stand_in = re.compile(r'setattr\(\s*torch\s*,\s*"compile"|backend\s*=\s*"(aot_eager|eager)"')
    for path in (REPO / "tests").glob("*.py"):
        assert not stand_in.search(path.read_text()), path.name


# what Compiled catches, and what it leaves to the caller


def test_a_graph_break_falls_back_with_one_warning_and_runs_the_function_once(caplog):
    calls = []

    def fn(x):
        calls.append(1)  # eager calls only: the compiler refuses the function before any of it runs
        torch._dynamo.graph_break()
        return x * 2

    doubled = Compiled(fn, "a doubling", mode="default")
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            assert torch.equal(doubled(torch.ones(2)), torch.full((2,), 2.0))
    assert "graph_break" in doubled.failed and len(calls) == 2
    said = [r.getMessage() for r in caplog.records if FELL_BACK in r.getMessage()]
    assert len(said) == 1 and "a doubling" in said[0]


def test_an_error_of_the_compiled_code_is_the_callers_and_nothing_runs_twice():
    """An index out of range inside the compiled code (what a device-side assert is on a GPU; an
    out-of-memory error is raised the same way): raised as it is, the function not run again eagerly,
    and it stays compiled."""
    eager_calls = []

    def eager(x, i):
        eager_calls.append(1)
        return x[i]

    pick = Compiled(eager, "a pick", mode="default", compiled=torch.compile(lambda x, i: x[i], fullgraph=True))
    assert torch.equal(pick(torch.arange(3.0), torch.tensor([2])), torch.tensor([2.0]))
    with pytest.raises(RuntimeError, match="out of bounds"):
        pick(torch.arange(3.0), torch.tensor([5]))
    assert pick.failed is None and not eager_calls


def test_a_bad_input_at_a_new_shape_is_the_callers_error_and_it_stays_compiled():
    """Shapes that do not fit fail while the compiler traces them (a fake-tensor error): the caller's error, as
    the eager function raises it, and the next good input still runs compiled."""
    matmul = Compiled(lambda a, b: a @ b, "a product", mode="default", compiled=torch.compile(lambda a, b: a @ b))
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        matmul(torch.ones(2, 3), torch.ones(4, 5))
    assert matmul.failed is None


def test_running_out_of_memory_while_compiling_is_the_callers_error_and_it_stays_compiled(monkeypatch):
    """Inductor runs kernels on real tensors while it compiles (to choose among them): an out-of-memory error
    there is raised as one, not taken for a compiler failure that turns compiling off for good."""
    from torch._inductor.graph import GraphLowering

    torch._dynamo.reset()

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("planted: out of memory while benchmarking")

    monkeypatch.setattr(GraphLowering, "compile_to_module", out_of_memory)
    double = Compiled(lambda x: x * 2, "a doubling", mode="default")
    with torch._inductor.config.patch(fx_graph_cache=False), pytest.raises(torch.OutOfMemoryError, match="planted"):
        double(torch.ones(2))  # compiled, not read from the cache
    assert double.failed is None


def test_a_compiler_error_is_said_in_one_line_that_says_what():
    from captioner.compiled import first_line

    error = RuntimeError("backend='inductor' raised:\nCalledProcessError: ...\n\nSet TORCHDYNAMO_VERBOSE=1\n")
    assert first_line(error) == "RuntimeError: backend='inductor' raised: CalledProcessError: ..."


def test_selfcheck_fails_a_mode_in_which_a_compiled_function_fell_back(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        json.dumps({"event": "start"}) + "\n" + json.dumps({"event": "compiled_failed", "message": "the step"}) + "\n"
    )
    with pytest.raises(RuntimeError, match="the step"):
        selfcheck._compile_failures(str(tmp_path))
    with open(tmp_path / "log", "w") as log, pytest.raises(RuntimeError, match="fell back: the search"):
        selfcheck._run(["python", "-c", f"print('warning: {FELL_BACK}: the search x')"], log)


@pytest.mark.slow
def test_recompiles_past_the_limit_fall_back_with_a_warning(caplog):
    doubled = Compiled(lambda x: x * 2, "a doubling", mode="default", limit=1)
    assert torch.equal(doubled(torch.ones(2)), torch.full((2,), 2.0))
    with caplog.at_level(logging.WARNING):
        assert torch.equal(doubled(torch.ones(3)), torch.full((3,), 2.0))  # another shape: a second compile
    assert doubled.failed and [r.getMessage() for r in caplog.records if FELL_BACK in r.getMessage()]


# the training step


def test_a_step_the_compiler_refuses_trains_eagerly_and_says_so_once(data_dir, tmp_path, monkeypatch):
    """`fit --compile` whose step breaks its graph: the losses of eager steps, and one warning in the log."""
    eager = _losses(_fit(data_dir, tmp_path / "eager", shapes="fixed"))
    graph_break_in_the_cross_entropy(monkeypatch)
    lines = _fit(data_dir, tmp_path / "refused", compile=True)
    assert [s for s, _ in _losses(lines)] == [s for s, _ in eager]
    assert [v for _, v in _losses(lines)] == pytest.approx([v for _, v in eager], rel=1e-5, abs=1e-6)
    failed = [x["message"] for x in lines if x["event"] == "compiled_failed"]
    assert len(failed) == 1 and failed[0].startswith(FELL_BACK)
    assert "the training step's forward and backward" in failed[0] and "graph_break" in failed[0]
    with pytest.raises(RuntimeError, match="graph_break"):
        selfcheck._compile_failures(str(tmp_path / "refused"))


def fixed_batch(data_dir):
    """The first fixed-shape batch of 8 captions of the prepared scenes."""
    from captioner.data.batches import CaptionBatches, FixedShapes
    from captioner.data.dataset import CaptionData

    data = CaptionData(str(data_dir))
    fixed = FixedShapes.for_data(8, int(data.lengths.max()))
    return next(iter(CaptionBatches(data, 8, fixed=fixed).batches(seed=0, epoch=0)))


def seeded_step(data_dir, compiled: str | None, *, dropout: float):
    """A small decoder drawn from seed 0 and the fixed-shape step `fit` would train it with (compiled or not)."""
    from conftest import train_step

    from captioner.data.dataset import CaptionData

    data = CaptionData(str(data_dir))
    torch.manual_seed(0)
    dec = AttentionDecoder(vocab_size=len(data.vocab), embed_dim=16, hidden_dim=24, attention_dim=12, dropout=dropout)
    dec.set_feature_stats(*data.feature_stats())
    return dec, train_step(dec, TrainConfig.of(shapes="fixed", consistency=0), compiled=compiled)


@pytest.mark.slow
def test_the_compiled_step_trains_as_the_eager_one_whole(data_dir):
    """Inductor's step (forward and backward) on one length bucket: one graph, no break, no fallback, and
    the eager step's losses (nothing is drawn: no dropout, no views)."""
    batch, losses = fixed_batch(data_dir), {}
    for compiled in (None, "default"):
        _, step = seeded_step(data_dir, compiled, dropout=0.0)
        graphs, breaks = graphs_compiled(), sum(counters["graph_break"].values())
        losses[compiled] = []
        for _ in range(3):
            step(batch)
            losses[compiled].append(step.read()[0]["loss"])
    assert step.passes.failed is None and step.passes.seconds > 0
    assert graphs_compiled() - graphs == 1 and sum(counters["graph_break"].values()) == breaks
    assert losses["default"] == pytest.approx(losses[None], rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=ON_A_GPU)])
def test_five_compiled_fits_in_one_process_share_one_compiled_forward(device, data_dir, tmp_path, monkeypatch):
    """Notebooks, the demo's build and test sessions fit several times in one process: every fit's steps call the
    one compiled forward (a compile of its own each would spend the compiler's recompile budget anew), later fits
    reuse the first fit's graphs, one per length bucket, and no fit falls back: on the CPU in the default mode, on a
    GPU in reduce-overhead."""
    steps, made = [], train_setup.train_step

    def recorded(*args):
        steps.append(made(*args))
        return steps[-1]

    monkeypatch.setattr(train_setup, "train_step", recorded)
    torch._dynamo.reset()
    graphs = []
    for i in range(5):
        before = graphs_compiled()
        lines = _fit(data_dir, tmp_path / f"fit{i}", device, compile=True)
        assert not [x for x in lines if x["event"] == "compiled_failed"], i
        graphs.append(graphs_compiled() - before)
    assert len({id(getattr(s.module.forward, "func", s.module.forward)) for s in steps}) == 1 and len(steps) == 5
    assert graphs[0] >= 2 and graphs[1:] == [0, 0, 0, 0], graphs


@pytest.mark.slow
def test_a_backward_the_compiler_refuses_falls_back_before_the_step_runs(data_dir, monkeypatch):
    """A failure in compiling the backward (AOTAutograd compiles it lazily, at the first `.backward()`, by
    default) comes before anything ran: the forward runs once, eagerly, so the step leaves the random state
    and the weights where the eager step leaves them."""
    import torch._inductor.compile_fx as compile_fx

    batch, after = fixed_batch(data_dir), {}
    for compiled in (None, "default"):
        dec, step = seeded_step(data_dir, compiled, dropout=0.3)
        if compiled:
            torch._dynamo.reset()

            def refused(*args, **kwargs):
                raise RuntimeError("planted: the backward does not compile")

            monkeypatch.setattr(compile_fx, "compile_fx_backward", refused)
        step(batch)
        after[compiled] = torch.get_rng_state(), [p.detach().clone() for p in dec.parameters()], step.read()[0]
    assert "planted" in step.passes.failed
    assert torch.equal(after["default"][0], after[None][0])  # the forward drew its dropout masks once
    assert after["default"][2]["loss"] == pytest.approx(after[None][2]["loss"], rel=1e-6)
    for ours, eager in zip(after["default"][1], after[None][1]):
        torch.testing.assert_close(ours, eager, rtol=1e-6, atol=1e-7)


# the search


@pytest.mark.slow
def test_a_search_at_any_length_and_sharpness_shares_one_compile(fresh_search):
    """max_len 20, 21 and 5, and maps of sharpness 1, 1.5 and 3: each search the eager search's captions and
    maps (cut at its own length), all from the one graph compiled first: the length and the sharpness are
    tensors of the compiled block, not constants."""
    decoder, feats = tiny_decoder(), torch.randn(2, 196, 512)
    graphs = None
    for max_len, sharpness in ((20, None), (21, 1.5), (5, 3.0), (20, 1.0)):
        settings = dict(beam_size=3, max_len=max_len, shapes="fixed", sharpness=sharpness)
        got = beam_search(decoder, feats, compiled=True, **settings)
        same_search(got, beam_search(decoder, feats, compiled=False, **settings))
        assert max(len(h.tokens) for hyps in got for h in hyps) == max_len
        graphs = graphs or graphs_compiled()
    assert compiled_block("default").failed is None and graphs_compiled() == graphs


@pytest.mark.slow
def test_searches_read_their_large_inputs_from_one_place(fresh_search):
    """A compiled search copies its features, their projection, the joined weights and the masks into the
    thread's buffers, so that one search after another hands the compiled block the same memory (which a
    CUDA graph then reads without copying it in again)."""
    from captioner.decoding.search_state import Search, fixed_length

    decoder = tiny_decoder()
    places = []
    for seed in (0, 1):
        feats = torch.randn(2, 196, 512, generator=torch.Generator().manual_seed(seed))
        s = Search.start(decoder, feats, 3, fixed_length(20), static=True)
        places.append([t.data_ptr() for t in (s.feats, s.projected, s.ban, s.pad_only, *s.joined)])
        torch.testing.assert_close(s.feats[3:6], decoder.normalize(feats)[1:2].expand(3, -1, -1))
    assert places[0] == places[1]


def compiling_on_this_cpu(monkeypatch, source: str, device: str = "cpu"):
    """A Captioner whose search compiles where a GPU's would (`compile_search`), on a CPU in the default mode."""
    from captioner.serve import api

    monkeypatch.setattr(api, "search_compiles", lambda device, graphs: graphs)
    return api.Captioner.load(source, device=device)


@ON_A_GPU
def test_a_compiled_search_on_a_gpu_copies_its_large_inputs_once_not_at_every_replay(fresh_search, monkeypatch):
    """A search of 20 steps replays its CUDA graph 6 times. What PyTorch's graph trees copy into the graph's
    own inputs at each replay (`_copy_inputs_and_remove_from_src`, counted here): with the search's inputs in
    static buffers, less than the beams' features once a search; with plain inputs, those features and their
    projection at every replay."""
    from torch._inductor import cudagraph_trees

    from captioner.decoding import search_state

    decoder, feats = tiny_decoder().cuda(), torch.randn(8, 196, 512, device="cuda")
    copied_bytes = []
    copy = cudagraph_trees.CUDAGraphNode._copy_inputs_and_remove_from_src

    def counted(node, dsts, srcs):
        plain = [srcs[i] for i in node.non_static_input_idx if torch.is_tensor(srcs[i])]
        copied_bytes.append(sum(t.numel() * t.element_size() for t in plain))
        return copy(node, dsts, srcs)

    monkeypatch.setattr(cudagraph_trees.CUDAGraphNode, "_copy_inputs_and_remove_from_src", counted)

    def bytes_a_search() -> int:
        for _ in range(3):  # compile, record, replay
            beam_search(decoder, feats, beam_size=3, max_len=20, compiled=True)
        copied_bytes.clear()
        beam_search(decoder, feats, beam_size=3, max_len=20, compiled=True)
        return sum(copied_bytes)

    features = 24 * 196 * 512 * 4  # the beams' features, in bytes
    static = bytes_a_search()
    monkeypatch.setattr(search_state, "static_copy", lambda name, t: t)
    plain = bytes_a_search()
    assert compiled_block(GRAPHS).failed is None and not compiled_block(GRAPHS).graphless
    assert static < features and plain >= 5 * features, (static, plain)


def test_a_server_whose_compile_is_refused_answers_every_request_eagerly(fresh_search, monkeypatch):
    """The demo's batcher over a model whose search the compiler refuses: the request that met the refusal
    and every later one get the captions of an eager search."""
    from captioner.serve import api
    from captioner.serve.batcher import Batcher
    from captioner.serve.sources import demo_model, example_images

    cap = compiling_on_this_cpu(monkeypatch, demo_model())
    want = [c.text for c in cap.caption_batch(example_images()[:3])]
    step = AttentionDecoder.step

    def breaking(self, *args, **kwargs):
        torch._dynamo.graph_break()
        return step(self, *args, **kwargs)

    monkeypatch.setattr(AttentionDecoder, "step", breaking)
    cap.compiling = api.search_compiles(cap.device, cap.graphs)
    batcher = Batcher(cap)
    try:
        got = [batcher.caption(im).text for im in example_images()[:3]]
    finally:
        batcher.close()
    assert got == want
    assert "graph_break" in compiled_block("default").failed


def test_a_static_search_holds_every_large_input_in_a_marked_buffer():
    """What a compiled search reads as static inputs (not copied into a CUDA graph at each replay) is marked
    so: the features, their projection, the joined weights and each of the four word masks."""
    from captioner.decoding.search_state import Search

    s = Search.start(tiny_decoder(), torch.randn(2, 196, 512), 3, 4, static=True)
    held = [s.feats, s.projected, *s.joined, s.ban, s.ban_first, s.only_end, s.pad_only]
    assert all(getattr(t, "_dynamo_static_input_type", None) for t in held)


@pytest.mark.slow
def test_a_warmed_up_server_searches_in_buffers_that_stay_put(fresh_search, monkeypatch):
    """The warm-up's first search allocates each static buffer at the largest shape it will serve, so that no
    later search moves one (on a GPU a graph whose static input moved is recorded again, on the serving path)."""
    from captioner.decoding import search_state
    from captioner.decoding.settings import Decoding
    from captioner.serve.sources import demo_model, example_images

    cap = compiling_on_this_cpu(monkeypatch, demo_model())
    places, copy = {}, search_state.static_copy

    def recorded(name, t):
        view = copy(name, t)
        places.setdefault(name, set()).add(view.data_ptr())
        return view

    monkeypatch.setattr(search_state, "static_copy", recorded)
    cap.compile_search([1, 2, 4], [Decoding(beam_size=k) for k in (1, 2, 3)])
    for images, k in ((1, 3), (3, 2), (4, 3), (2, 1)):
        cap.caption_batch(example_images()[:images], beam_size=k)
    assert compiled_block("default").failed is None
    assert places and all(len(at) == 1 for at in places.values()), places


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=ON_A_GPU)])
def test_a_server_compiles_on_the_thread_that_serves_and_serves_other_settings_compiled(
    fresh_search, monkeypatch, device
):
    """The batcher compiles the page's searches on its own thread before it serves (PyTorch keeps CUDA graphs
    per thread); then requests at beam 3, at beam 5 and with max lengths 20 and 21 run on what it compiled:
    no new compile, no fallback (on a GPU: CUDA graphs for all, none recorded after the warm-up), the captions of
    an eager search."""
    from captioner.compiled import compile_mode
    from captioner.decoding.settings import Decoding
    from captioner.serve.batcher import Batcher
    from captioner.serve.sources import demo_model, example_images

    recorded = []
    if device == "cuda":  # PyTorch's graph trees record a graph on its first replay, and again when an input moved
        from torch._inductor.cudagraph_trees import CUDAGraphTreeManager

        record = CUDAGraphTreeManager.record_function
        monkeypatch.setattr(CUDAGraphTreeManager, "record_function", lambda *a: recorded.append(1) or record(*a))
    cap = compiling_on_this_cpu(monkeypatch, demo_model(), device)
    images = example_images()[:2]
    warm = [Decoding(beam_size=k) for k in (1, 3, 5)]
    batcher = Batcher(cap, max_batch_size=2, warm=warm)
    try:
        assert batcher.ready.result() > 0
        block = compiled_block(compile_mode(cap.device, graphs=True))
        assert block.threads == {batcher.thread.ident} != {threading.get_ident()}
        graphs, warmed = graphs_compiled(), len(recorded)
        for settings in (Decoding(beam_size=3), Decoding(beam_size=5), Decoding(max_len=20), Decoding(max_len=21)):
            got = [batcher.caption(im, settings) for im in images]
            cap.compiling = False
            want = cap.caption_batch(images, decoding=settings)
            cap.compiling = True
            assert [c.text for c in got] == [c.text for c in want]
            for a, b in zip(got, want):
                np.testing.assert_allclose(a.attention, b.attention, atol=1e-4)
        assert graphs_compiled() == graphs and block.failed is None and not block.graphless
        assert len(recorded) == warmed, f"{len(recorded) - warmed} CUDA graphs recorded while serving"
    finally:
        batcher.close()


def test_a_validation_that_fails_leaves_its_epoch_to_validate_on_resume(data_dir, tmp_path, monkeypatch):
    """A failure inside validation (a search that broke, an out-of-memory) saves last.pt with the epoch's
    steps, not counting the epoch: `fit --resume` validates it before it goes on."""
    import captioner.train.trainer as trainer_module
    from captioner.models.checkpoint import load_checkpoint

    validate = trainer_module.validate

    def breaks(*args, **kwargs):
        raise RuntimeError("injected failure during validation")

    monkeypatch.setattr(trainer_module, "validate", breaks)
    run = tmp_path / "run"
    with pytest.raises(RuntimeError, match="during validation"):
        _fit(data_dir, run, epochs=2)
    progress = load_checkpoint(str(run / "last.pt"))["progress"]
    assert progress["epoch"] == 0 and progress["batch_in_epoch"] == progress["step"] > 0
    monkeypatch.setattr(trainer_module, "validate", validate)
    lines = _fit(data_dir, run, epochs=2)
    resumed = lines[max(i for i, x in enumerate(lines) if x["event"] == "start") :]
    assert [x["epoch"] for x in resumed if x["event"] == "val"] == [1, 2]
    assert [x["step"] for x in resumed if x["event"] == "train"][0] > progress["step"]  # no step trained twice


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
